"""Figures and tables of `kvserve bench gateway`.

Per run: the fleet's prefix hit rate (the workers' own counters: prompt tokens served from cache /
prompt tokens looked up), the points it is below the `ideal` run of the same case, TTFT and
end-to-end latency p50/p99 of the requests that completed (from their first send, so retries and
waits count), the TTFT p99 of every request with the lost ones counted slower than any (so
losing requests never buys a better p99), completed requests per second, lost requests (no
success by the deadline or the retry limit), retries (timed-out or failed attempts resent),
429/503 answers, and each worker's share of the prompt tokens. Behind a kvserve gateway, the
policy's predicted cached tokens against the worker's reported ones, per request
(`prediction_accuracy`). Of the lost requests, those that ended on a clean HTTP error answer
(`errored`) and those that got no answer at all (`unanswered`). With LoRA adapters: each
worker's adapter loads over the run and the fleet's loads per completed request (gateway_lora.py
says what is counted on each kind of worker).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.gateway_counters import CounterPoller
from kvserve.bench.gateway_load import RequestResult
from kvserve.bench.gateway_workload import GatewayRequest
from kvserve.gateway.core.prefix import CHARS_PER_TOKEN
from kvserve.percentiles import at_rank, percentile


@dataclass(slots=True)
class CaseRun:
    case: str
    router: str
    replicas: int
    requests: int
    completed: int
    lost: int
    hit_rate: float
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    request_throughput: float
    retries: int
    rejections: int
    worker_shares: list[float]
    duration_s: float
    actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ideal_gap_pts: float = float("nan")
    sim: dict[str, Any] | None = None  # the simulator's figures (--calibrate)
    router_stats: dict[str, float] = field(default_factory=dict)  # kvserve gateways' /metrics
    seed: int = 0  # of the workload (--seed, + the repeat's index with --repeats)
    ttfts_ms: list[float] = field(default_factory=list)  # every completed request's, sorted
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)  # "router", "workers"
    # Each completed request in arrival order: [index, TTFT ms, prompt tokens, cached tokens,
    # 429/503 answers, client timeouts, other failed attempts] (the tokens as the worker's
    # usage reports them, None where it reports none; the counts over the request's attempts).
    per_request: list[list[float | None]] = field(default_factory=list)
    ttft_p99_with_lost_ms: float = float("nan")  # the lost counted as infinitely slow
    lost_by_error: dict[str, int] = field(default_factory=dict)  # why each lost one was
    # [predicted, achieved] cached prompt tokens of each completed request that has both (the
    # gateway's header, the worker's usage), and their summary (`prediction_accuracy`).
    predicted_vs_cached: list[list[int]] = field(default_factory=list)
    prediction: dict[str, float] = field(default_factory=dict)
    errored: int = 0  # of the lost, those that ended on a clean HTTP error answer
    unanswered: int = 0  # of the lost, those that got no answer (lost = errored + unanswered)
    adapter_loads: list[float] | None = None  # each worker's, over the run; None: no adapters
    adapter_loads_per_request: float = float("nan")  # the fleet's, per completed request

    def one_line(self) -> str:
        return (f"hit {self.hit_rate:.3f} · TTFT p50 {self.ttft_ms['p50']:.0f} ms "
                f"p99 {self.ttft_ms['p99']:.0f} ms · {self.completed}/{self.requests} done · "
                f"{self.retries} retries · {self.rejections} 429s · "
                + (f"adapter loads/request {self.adapter_loads_per_request:.2f} · "
                   if self.adapter_loads is not None else "")
                + "shares "
                f"{'/'.join(f'{s:.2f}' for s in self.worker_shares)}"
                + (f" · {'; '.join(self.actions)}" if self.actions else "")
                + (" · CPU/request " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                 sorted(self.cpu_ms_per_request.items()))
                   if self.cpu_ms_per_request else "")
                + (" · gateway " + ", ".join(f"{k} {v:.0f}" for k, v in
                                            sorted(self.router_stats.items()))
                   if self.router_stats else ""))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stats(values: Sequence[float]) -> dict[str, float]:
    def pct(p: float) -> float:
        v = percentile(values, p)
        return float("nan") if v is None else v

    return {"p50": pct(50), "p99": pct(99),
            "mean": sum(values) / len(values) if values else float("nan")}


def percentile_with_lost(completed_ms: Sequence[float], lost: int, q: float) -> float:
    """The q-th percentile of TTFT over every request, the `lost` ones infinitely slow:
    infinite once q reaches into them."""
    ordered = sorted(completed_ms)
    n = len(ordered) + lost
    if n == 0:
        return float("nan")
    pos = (n - 1) * q / 100.0
    return math.inf if math.ceil(pos) >= len(ordered) else at_rank(ordered, pos)


def tail_makeup(per_request: Sequence[Sequence[float | None]], q: float = 99.0) -> dict[str, int]:
    """What the completed requests at or above the q-th TTFT percentile were (`per_request`
    rows as `CaseRun.per_request`): how many (`n`), and of those how many were cold prefills
    (under half the prompt served from cache, as the worker reports it), were answered 429/503
    at least once (`refused`), timed out at the client at least once (`timed_out`), or had
    another attempt fail (`failed`). One request may count in several; an empty tail for no
    rows."""
    makeup = {"n": 0, "cold": 0, "refused": 0, "timed_out": 0, "failed": 0}
    threshold = percentile([float(row[1] or 0.0) for row in per_request], q)
    if threshold is None:
        return makeup
    for _, ttft, prompt, cached, refused, timed_out, failed in per_request:
        if ttft is None or ttft < threshold:
            continue
        makeup["n"] += 1
        makeup["cold"] += int(prompt is not None and cached is not None and cached < prompt / 2)
        makeup["refused"] += int(bool(refused))
        makeup["timed_out"] += int(bool(timed_out))
        makeup["failed"] += int(bool(failed))
    return makeup


def tail_label(makeup: dict[str, int]) -> str:
    """`tail_makeup` in a table cell: "6: 5 cold, 1 refused"."""
    parts = [f"{makeup[k]} {k.replace('_', ' ')}" for k in ("cold", "refused", "timed_out",
                                                               "failed") if makeup[k]]
    return f"{makeup['n']}: " + (", ".join(parts) if parts else "warm, first try")


def prediction_accuracy(pairs: Sequence[Sequence[int]], block_tokens: int) -> dict[str, float]:
    """How well [predicted, achieved] cached-token pairs agree: `n` pairs, `exact` (equal),
    `within_block` (apart by at most `block_tokens`, the workers' KV block: an engine computes
    at least the prompt's last token, so a fully cached prompt reports one block less), the mean
    absolute error in tokens, and how many were predicted `over` / `under` by more than a
    block. Empty for no pairs; ValueError for a block size below 1."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if not pairs:
        return {}
    errors = [predicted - achieved for predicted, achieved in pairs]
    return {"n": len(pairs), "exact": sum(e == 0 for e in errors),
            "within_block": sum(abs(e) <= block_tokens for e in errors),
            "mae_tokens": sum(abs(e) for e in errors) / len(errors),
            "over": sum(e > block_tokens for e in errors),
            "under": sum(e < -block_tokens for e in errors)}


def _predicted_tokens(result: RequestResult, request: GatewayRequest, text_keyed: bool) -> int:
    predicted = result.predicted_cached_tokens
    assert predicted is not None
    if not text_keyed or not result.prompt_tokens:
        return predicted
    return round(predicted * CHARS_PER_TOKEN * result.prompt_tokens / len(request.prompt))


def _ms(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.0f}"


def summarize(case: str, router: str, replicas: int, requests: Sequence[GatewayRequest],
              results: Sequence[RequestResult], duration_s: float, poller: CounterPoller,
              actions: Sequence[str], seed: int = 0, block_tokens: int = 16,
              text_keyed: bool = False) -> CaseRun:
    """One run's figures. `block_tokens`: the workers' KV block; `text_keyed`: the gateway's
    policy keys prompts by characters, so its predicted tokens are characters over
    CHARS_PER_TOKEN, converted here to the worker's tokens at the prompt's own ratio."""
    ok = [r for r in results if r.ok]
    pairs = [[_predicted_tokens(r, q, text_keyed), r.cached_tokens]
             for q, r in zip(requests, results, strict=True) if r.ok
             and r.predicted_cached_tokens is not None and r.cached_tokens is not None]
    ttfts = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s is not None)
    loads = poller.adapter_loads()
    errored = sum(not r.ok and r.final_status is not None for r in results)
    return CaseRun(
        case=case, router=router, replicas=replicas, requests=len(requests),
        completed=len(ok), lost=len(results) - len(ok), hit_rate=poller.hit_rate(),
        ttft_ms=_stats(ttfts), seed=seed, ttfts_ms=ttfts,
        e2e_ms=_stats([r.e2e_s * 1e3 for r in ok if r.e2e_s is not None]),
        request_throughput=len(ok) / duration_s if duration_s > 0 else float("nan"),
        retries=sum(r.timeouts + r.failures for r in results),
        rejections=sum(r.rejections for r in results),
        worker_shares=poller.shares(), duration_s=duration_s, actions=list(actions),
        errors=list(dict.fromkeys(r.error for r in results if r.error))[:3],
        per_request=[[i, round(r.ttft_s * 1e3, 1), r.prompt_tokens, r.cached_tokens,
                      r.rejections, r.timeouts, r.failures]
                     for i, r in enumerate(results) if r.ok and r.ttft_s is not None],
        ttft_p99_with_lost_ms=percentile_with_lost(ttfts, len(results) - len(ok), 99),
        lost_by_error=dict(Counter(r.error or "unknown" for r in results if not r.ok)),
        predicted_vs_cached=pairs, prediction=prediction_accuracy(pairs, block_tokens),
        errored=errored, unanswered=len(results) - len(ok) - errored, adapter_loads=loads,
        adapter_loads_per_request=(sum(loads) / len(ok) if loads is not None and ok
                                   else float("nan")))


def fill_ideal_gaps(runs: Sequence[CaseRun]) -> None:
    """Points of hit rate below the ideal split of the same case and seed (base's ideal for
    the replica cases, where the clients' split has no replicas)."""
    ideal = {(r.case, r.seed): r.hit_rate for r in runs if r.router == "ideal"}
    for run in runs:
        ref = ideal.get((run.case, run.seed), ideal.get(("base", run.seed))
                        if run.case.startswith("replicas") else None)
        if ref is not None and not math.isnan(ref):
            run.ideal_gap_pts = (ref - run.hit_rate) * 100.0


def print_tables(runs: Sequence[CaseRun], title: str) -> None:
    fill_ideal_gaps(runs)
    table = Table(title=title, title_justify="left")
    for col in ("case", "seed", "router", "hit rate", "below ideal (pts)", "TTFT p50 ms",
                "TTFT p99 ms", "p99, lost = ∞",
                "e2e p99 ms", "req/s", "done", "lost", "retries", "429s", "worker shares"):
        table.add_column(col, justify="left" if col in ("case", "router") else "right")
    for r in runs:
        table.add_row(
            r.case, str(r.seed), r.router + (f" x{r.replicas}" if r.replicas > 1 else ""),
            f"{r.hit_rate:.3f}", "" if math.isnan(r.ideal_gap_pts) else f"{r.ideal_gap_pts:.1f}",
            f"{r.ttft_ms['p50']:.0f}", f"{r.ttft_ms['p99']:.0f}", _ms(r.ttft_p99_with_lost_ms),
            f"{r.e2e_ms['p99']:.0f}",
            f"{r.request_throughput:.2f}", f"{r.completed}/{r.requests}", str(r.lost),
            str(r.retries), str(r.rejections),
            "/".join(f"{s:.2f}" for s in r.worker_shares))
    Console(width=200).print(table)
    print_adapter_loads(runs)
    print_prediction(runs)
    for r in runs:
        if r.actions or r.errors:
            print(f"{r.case} · {r.router}: " + "; ".join(r.actions + r.errors))


def print_pooled(runs: Sequence[CaseRun]) -> None:
    """With --repeats: each case and router over its seeds. Hit rate and its gap to the ideal
    are means over the seeds; TTFT percentiles pool every completed request of every seed (a p99
    of 160 requests is the second-worst one, so single runs move a lot)."""
    fill_ideal_gaps(runs)
    groups: dict[tuple[str, str, int], list[CaseRun]] = {}
    for r in runs:
        groups.setdefault((r.case, r.router, r.replicas), []).append(r)
    if all(len(g) < 2 for g in groups.values()):
        return
    table = Table(title="pooled over seeds", title_justify="left")
    for col in ("case", "router", "seeds", "hit rate (mean)", "hit min-max", "below ideal (pts)",
                "TTFT p50 ms", "TTFT p99 ms", "p99, lost = ∞", "done", "lost", "retries",
                "429s", "at or above p99"):
        table.add_column(col, justify="left" if col in ("case", "router") else "right")
    for (case, router, replicas), group in groups.items():
        hits = [r.hit_rate for r in group]
        gaps = [r.ideal_gap_pts for r in group if not math.isnan(r.ideal_gap_pts)]
        completed = sorted(t for r in group for t in r.ttfts_ms)
        ttft = _stats(completed)
        with_lost = percentile_with_lost(completed, sum(r.lost for r in group), 99)
        table.add_row(
            case, router + (f" x{replicas}" if replicas > 1 else ""), str(len(group)),
            f"{sum(hits) / len(hits):.3f}", f"{min(hits):.3f}-{max(hits):.3f}",
            f"{sum(gaps) / len(gaps):.1f}" if gaps else "", f"{ttft['p50']:.0f}",
            f"{ttft['p99']:.0f}", _ms(with_lost), f"{sum(r.completed for r in group)}/"
            f"{sum(r.requests for r in group)}", str(sum(r.lost for r in group)),
            str(sum(r.retries for r in group)), str(sum(r.rejections for r in group)),
            tail_label(tail_makeup([row for r in group for row in r.per_request])))
    Console(width=220).print(table)


def print_prediction(runs: Sequence[CaseRun]) -> None:
    """Per run behind a kvserve gateway: the policy's predicted cached tokens against the
    worker's, per request (`prediction_accuracy`); nothing when no run has both."""
    rows = [r for r in runs if r.prediction]
    if not rows:
        return
    table = Table(title="predicted vs achieved cached tokens, per request", title_justify="left")
    for col in ("case", "seed", "router", "requests", "exact", "within a block", "MAE tokens",
                "over", "under", "achieved mean"):
        table.add_column(col, justify="left" if col in ("case", "router") else "right")
    for r in rows:
        p = r.prediction
        n = int(p["n"])
        achieved = sum(a for _, a in r.predicted_vs_cached) / n
        table.add_row(r.case, str(r.seed), r.router + (f" x{r.replicas}" if r.replicas > 1
                                                       else ""), str(n),
                      f"{p['exact'] / n:.2f}", f"{p['within_block'] / n:.2f}",
                      f"{p['mae_tokens']:.0f}", str(int(p["over"])), str(int(p["under"])),
                      f"{achieved:.0f}")
    Console(width=200).print(table)


def print_adapter_loads(runs: Sequence[CaseRun]) -> None:
    """Per run over adapter-serving workers: adapter loads (each worker's, the fleet's per
    completed request), the hit rate beside them, and what became of the requests (done,
    ended on a clean HTTP error, no answer at all); nothing when no run served adapters."""
    rows = [r for r in runs if r.adapter_loads is not None]
    if not rows:
        return
    table = Table(title="LoRA adapters: loads into a slot", title_justify="left")
    for col in ("case", "seed", "router", "loads/request", "loads", "per worker", "hit rate",
                "done", "clean errors", "lost (no answer)"):
        table.add_column(col, justify="left" if col in ("case", "router") else "right")
    for r in rows:
        loads = r.adapter_loads or []
        table.add_row(r.case, str(r.seed), r.router + (f" x{r.replicas}" if r.replicas > 1
                                                       else ""),
                      f"{r.adapter_loads_per_request:.3f}", f"{sum(loads):.0f}",
                      "/".join(f"{x:.0f}" for x in loads), f"{r.hit_rate:.3f}",
                      f"{r.completed}/{r.requests}", str(r.errored), str(r.unanswered))
    Console(width=200).print(table)
