"""`python -m benchmarks gateway` (the case suite) and the pieces it shares with `kvserve bench
gateway`: its workload, its client-side pieces, and one real small run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import with_repo_on_path
from kvserve.bench.gateway_counters import CounterTotals
from kvserve.bench.gateway_fleet import RouterSpec
from kvserve.bench.gateway_report import prediction_accuracy
from kvserve.bench.gateway_workload import (
    BlockTexts,
    GatewayRequest,
    gateway_requests,
    ideal_assignment,
    tenant_trace,
    working_set_tokens,
)
from kvserve.bench.serve_prompts import PromptBuilder
from kvserve.bench.server_launch import CpuReading, ManagedProcess
from kvserve.model import Tokenizer
from kvserve.runtime.demo_model import ensure_demo_model
from kvserve.workload import TRACE_BLOCK_SIZE, MultiTenantSpec, TraceRequest


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_demo_model())


def test_prompts_have_the_trace_lengths_and_share_exactly_the_tenant_prefix(
    tokenizer: Tokenizer,
) -> None:
    spec = MultiTenantSpec(num_tenants=3, num_requests=12, prefix_tokens=(1024, 1536),
                           suffix_tokens=(20, 60), output_tokens=4, rate_per_s=10.0)
    trace = tenant_trace(spec)
    requests = gateway_requests(trace, BlockTexts(PromptBuilder(tokenizer)))
    bos = len(tokenizer.encode(""))
    for req, tr in zip(requests, trace, strict=True):
        assert len(tokenizer.encode(req.prompt)) == tr.input_length + bos
        assert req.tenant == tr.tenant and req.max_tokens == 4
    assert requests[0].arrival_s == 0.0
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_tenant: dict[str, list[TraceRequest]] = {}
    for tr in trace:
        by_tenant.setdefault(tr.tenant or "", []).append(tr)
    same = [r for r in requests if r.tenant == requests[0].tenant]
    other = next(r for r in requests if r.tenant != requests[0].tenant)
    prefix_blocks = len(set.intersection(*(set(t.hash_ids) for t in by_tenant[same[0].tenant])))
    assert len(same) > 1 and prefix_blocks >= 2
    shared = same[0].prompt[: common_prefix_len(same[0].prompt, same[1].prompt)]
    assert len(tokenizer.encode(shared, add_special_tokens=False)) >= (
        prefix_blocks * TRACE_BLOCK_SIZE - 1)
    assert common_prefix_len(requests[0].prompt, other.prompt) < 40


def common_prefix_len(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _request(tenant: str, tokens: int) -> GatewayRequest:
    return GatewayRequest(f"{tenant}-{tokens}", 0.0, tenant, "x", tokens, 1)


def test_the_ideal_split_pins_whole_tenants_by_prefix_footprint() -> None:
    # Footprints (shortest prompt): a 900, b 500, c 400, d 300; b's traffic is irrelevant.
    requests = [_request("a", 900), _request("b", 500), _request("c", 400), _request("d", 300),
                _request("b", 700), _request("b", 800)]
    assignment = ideal_assignment(requests, 2)
    assert assignment == {"a": 0, "b": 1, "c": 1, "d": 0}  # 900+300 | 500+400
    assert ideal_assignment(requests, 1) == dict.fromkeys("abcd", 0)
    with pytest.raises(ValueError, match="at least 1"):
        ideal_assignment(requests, 0)


def test_the_working_set_counts_content_read_more_than_once() -> None:
    shared = (1, 2)
    trace = [TraceRequest("r1", 0.0, 2 * TRACE_BLOCK_SIZE + 10, 1, (*shared, 10)),
             TraceRequest("r2", 1.0, TRACE_BLOCK_SIZE + 100, 1, (*shared, 11)),
             TraceRequest("r3", 2.0, 50, 1, (7,))]
    # Block 1 is read twice in full; block 2 is read twice (100 tokens of it at most once
    # in r2, whole in r1): it counts whole. Blocks 10, 11 and 7 are read once.
    assert working_set_tokens(trace) == 2 * TRACE_BLOCK_SIZE


def test_counter_totals_survive_a_worker_restart() -> None:
    totals = CounterTotals()
    totals.add(100.0, 40.0)  # the baseline: nothing counted yet
    totals.add(300.0, 190.0)
    totals.add(50.0, 20.0)  # the counters dropped: the worker restarted
    totals.add(80.0, 50.0)
    assert (totals.queries, totals.hits) == (200.0 + 50.0 + 30.0, 150.0 + 20.0 + 30.0)


def test_router_specs_are_checked() -> None:
    assert RouterSpec.parse("ideal").label == "ideal"
    assert RouterSpec.parse(" sglang:cache_aware ").label == "sglang:cache_aware"
    for bad in ("nginx:rr", "kvserve", "kvserve:"):
        with pytest.raises(ValueError, match="KIND:POLICY"):
            RouterSpec.parse(bad)


@pytest.mark.parametrize(("spec", "args"), [
    ("kvserve:cache_aware@backlog_weight=0@load_weight=2",
     ["--policy-option=backlog_weight=0", "--policy-option=load_weight=2"]),
    ("kvserve:precise@backlog_weight=0@--queue-timeout=0.5",
     ["--policy-option=backlog_weight=0", "--queue-timeout=0.5"]),
    ("kvserve:cache_aware@--no-latency-limit", ["--no-latency-limit"]),  # a flag alone
    ("envoy+kvserve-epp:prefix_hash@--max-queued=0", ["--max-queued=0"]),  # the picker's too
])
def test_router_specs_carry_policy_options_and_gateway_flags(spec: str, args: list[str]) -> None:
    variant = RouterSpec.parse(spec)
    assert (variant.label, variant.gateway_args) == (spec, args)


@pytest.mark.parametrize(("spec", "message"), [
    ("sglang:cache_aware@x=1", "kvserve policies only"),
    ("sglang:cache_aware@--queue-timeout=0.5", "kvserve policies only"),
    ("kvserve:cache_aware@backlog_weight", "KEY=VALUE"),
    ("kvserve:precise@--no-such-flag=1", "no flag '--no-such-flag=1'"),  # the gateway's parser
    ("kvserve:precise@--queue-timeout=soon", "invalid float value"),
])
def test_bad_router_specs_are_refused_before_any_process(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterSpec.parse(spec)


def test_worker_args_reach_the_workers_command_and_refuse_calibration(tmp_path: Path) -> None:
    from kvserve.bench.server_launch import KVSERVE, LaunchSpec, server_command

    spec = LaunchSpec(model_dir=tmp_path, served_model_name="m", kv_cache_bytes=1 << 20,
                      max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                      num_threads=1, extra_args=("--kv-host-tier-bytes=4096",))
    cmd, _ = server_command(KVSERVE, spec, 9999)
    assert cmd[-1] == "--kv-host-tier-bytes=4096" and "serve" in cmd
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gateway", "--calibrate", "zero",
         "--worker-arg=--kv-host-tier-bytes=4096"],
        capture_output=True, text=True, timeout=120, env=with_repo_on_path(os.environ),
        check=False)
    assert proc.returncode == 2 and "drop --worker-arg" in proc.stderr


def test_a_small_run_measures_every_router_and_survives_a_worker_kill(tmp_path: Path) -> None:
    """Real workers and a real `kvserve gateway`; SGLang's router pointed at nothing is skipped
    with a message. Calibration exercises the simulator on the same trace (instant steps:
    the numbers are not the point here, the plumbing is)."""
    out = tmp_path / "gw.json"
    env = with_repo_on_path(dict(os.environ, PEERS=str(tmp_path / "no-peers")))
    env.pop("KVSERVE_SGLANG_ROUTER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gateway", "--cases", "base,failover",
         "--routers", "ideal,kvserve:prefix_hash,sglang:cache_aware", "--tenants", "3",
         "--requests", "18", "--rate", "6", "--prefix-tokens", "512,1024",
         "--suffix-tokens", "16,32", "--output-tokens", "4", "--calibrate", "zero",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SGLang's router is not installed" in proc.stderr
    report = json.loads(out.read_text())
    runs = {(r["case"], r["router"]): r for r in report["runs"]}
    assert set(runs) == {("base", "ideal"), ("base", "kvserve:prefix_hash"),
                         ("failover", "ideal"), ("failover", "kvserve:prefix_hash")}
    for run in runs.values():
        assert run["completed"] == run["requests"] == 18 and run["lost"] == 0, run
        assert 0.0 < run["hit_rate"] < 1.0
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert sum(run["worker_shares"]) == pytest.approx(1.0)
        # Each completed request: its arrival index, TTFT, and the worker's own token counts.
        assert [r[0] for r in run["per_request"]] == list(range(18))
        assert sorted(r[1] for r in run["per_request"]) == pytest.approx(run["ttfts_ms"],
                                                                          abs=0.1)
        assert all(0 <= r[3] <= r[2] for r in run["per_request"])
        # ... and what its attempts met: 429/503s, client timeouts, other failures.
        assert sum(r[4] for r in run["per_request"]) == run["rejections"]
        assert sum(r[5] + r[6] for r in run["per_request"]) == run["retries"]
    ideal = runs[("base", "ideal")]
    assert ideal["hit_rate"] > 0.5  # three tenants, each pinned: most prompt tokens hit
    cached = [r[3] for r in ideal["per_request"]]
    assert cached[0] == 0 and sum(c > 0 for c in cached) >= 12  # the first is cold, most hit
    assert sum(r[6] for r in runs[("failover", "ideal")]["per_request"]) > 0  # resent
    # The gateway's predicted cached tokens, paired with the worker's: prefix_hash keeps no
    # index, so it predicts none; the clients' own split has no gateway to predict.
    assert ideal["predicted_vs_cached"] == [] and ideal["prediction"] == {}
    pairs = runs[("base", "kvserve:prefix_hash")]["predicted_vs_cached"]
    assert [p for p, _ in pairs] == [0] * 18
    assert [a for _, a in pairs] == [r[3] for r in runs[("base", "kvserve:prefix_hash")]
                                     ["per_request"]]
    failover = runs[("failover", "kvserve:prefix_hash")]
    assert [a.split(" at ")[0] for a in failover["actions"]] == ["kill worker 1",
                                                                 "restart worker 1"]
    base = runs[("base", "kvserve:prefix_hash")]
    assert base["sim"]["completed"] == 18
    # The simulator routes on the gateway's own keys and worker ids, so rendezvous puts each
    # tenant where the real gateway did. With instant steps it never spills; the real gateway
    # spills when two requests overlap on one worker, and then placement is load, not keys.
    if not base["router_stats"].get("branch:spill"):
        for measured, simulated in zip(base["worker_shares"], base["sim"]["worker_shares"],
                                       strict=True):
            assert abs(measured - simulated) < 0.03, (base["worker_shares"],
                                                      base["sim"]["worker_shares"])
    assert failover["sim"] is None  # a killed worker is not simulated
    assert "simulator vs measured" in proc.stdout


def test_prediction_accuracy_counts_misses_beyond_one_block() -> None:
    pairs = [[0, 0], [128, 112], [256, 0], [0, 96], [64, 64]]
    assert prediction_accuracy(pairs, 16) == {"n": 5, "exact": 2, "within_block": 3,
                                              "mae_tokens": (16 + 256 + 96) / 5, "over": 1,
                                              "under": 1}
    assert prediction_accuracy([], 16) == {}
    with pytest.raises(ValueError, match="block_tokens"):
        prediction_accuracy(pairs, 0)


def test_calibration_pools_the_requests_of_repeated_runs_before_taking_percentiles() -> None:
    from benchmarks.gateway_calibrate import calibration_rows
    from kvserve.bench.gateway_report import CaseRun

    def run(seed: int, ttfts: list[float]) -> CaseRun:
        return CaseRun(case="base", router="kvserve:cache_aware", replicas=1, requests=3,
                       completed=3, lost=0, hit_rate=0.5 + seed / 10, ttft_ms={},
                       e2e_ms={}, request_throughput=2.0 + seed, retries=0, rejections=0,
                       worker_shares=[1.0], duration_s=1.0, seed=seed, ttfts_ms=ttfts)

    runs = [run(0, [10.0, 20.0, 30.0]), run(1, [40.0, 50.0, 60.0])]
    sims = {0: {"ttfts_ms": [1.0, 2.0, 3.0], "request_throughput": 1.0, "hit_rate": 0.4},
            1: {"ttfts_ms": [4.0, 5.0, 6.0], "request_throughput": 3.0, "hit_rate": 0.6}}
    rows = calibration_rows(runs, sims)
    assert [r.seeds for r in rows] == ["0", "1", "pooled 0+1"]
    pooled = rows[-1]
    assert pooled.measured_ttfts == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert pooled.sim_ttfts == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert pooled.measured_rps == 2.5 and pooled.sim_rps == 2.0
    assert pooled.measured_hit == pytest.approx(0.55) and pooled.sim_hit == pytest.approx(0.5)
    # A (case, router) run once gets no pooled row.
    assert [r.seeds for r in calibration_rows(runs[:1], {0: sims[0]})] == ["0"]


def test_repeated_runs_are_pooled_per_case_and_router(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.bench.gateway_report import CaseRun, print_pooled

    def run(router: str, seed: int, hit: float, ttfts: list[float]) -> CaseRun:
        # The slowest request was a cold prefill that a 429 had sent back once.
        rows = [[i, t, 100, 0 if t == max(ttfts) else 90, int(t == max(ttfts)), 0, 0]
                for i, t in enumerate(ttfts)]
        return CaseRun(case="base", router=router, replicas=1, requests=3, completed=3, lost=0,
                       hit_rate=hit, ttft_ms={}, e2e_ms={}, request_throughput=1.0,
                       retries=seed, rejections=0, worker_shares=[1.0], duration_s=1.0,
                       seed=seed, ttfts_ms=ttfts, per_request=rows)

    print_pooled([run("ideal", 0, 0.9, [1.0, 2.0, 3.0]), run("kvserve:precise", 0, 0.8,
                                                           [10.0, 20.0, 30.0]),
                  run("ideal", 1, 0.7, [4.0, 5.0, 6.0]), run("kvserve:precise", 1, 0.7,
                                                           [40.0, 50.0, 60.0])])
    rows = {line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:-1]]
            for line in capsys.readouterr().out.splitlines() if line.count("│") > 10}
    seeds, mean, span, gap, p50, p99, with_lost, done, lost, retries, _, tail = rows[
        "kvserve:precise"]
    assert (seeds, mean, span, gap, done, lost, retries) == ("2", "0.750", "0.700-0.800", "5.0",
                                                             "6/6", "0", "1")
    assert float(p50) == pytest.approx(35.0) and 55.0 < float(p99) <= 60.0
    assert with_lost == p99  # nothing lost: the same p99
    assert tail == "1: 1 cold, 1 refused"  # of 6, only the slowest is at or above the p99
    print_pooled([run("ideal", 0, 0.9, [1.0])])  # one seed each: nothing to pool, no table
    assert capsys.readouterr().out == ""


def test_the_tail_says_what_its_requests_met() -> None:
    from kvserve.bench.gateway_report import tail_label, tail_makeup

    # [index, TTFT ms, prompt tokens, cached tokens, 429s, client timeouts, failed attempts]
    rows = [[i, 10.0 + i, 2000, 1984, 0, 0, 0] for i in range(196)]
    rows += [[196, 300.0, 2000, 0, 0, 0, 0], [197, 900.0, 2000, 1984, 2, 0, 0],
             [198, 3100.0, 2000, 1984, 0, 1, 1], [199, 250.0, None, None, 0, 0, 0]]
    makeup = tail_makeup(rows)  # p99 of 200: between the 198th and 199th slowest
    assert makeup == {"n": 2, "cold": 0, "refused": 1, "timed_out": 1, "failed": 1}
    assert tail_label(makeup) == "2: 1 refused, 1 timed out, 1 failed"
    assert tail_makeup(rows, 98) == {"n": 4, "cold": 1, "refused": 1, "timed_out": 1,
                                     "failed": 1}  # a request without usage is never cold
    assert tail_label(tail_makeup(rows[:10], 50)) == "5: warm, first try"
    assert tail_makeup([])["n"] == 0


def test_lost_requests_count_as_slower_than_any_in_the_p99() -> None:
    from kvserve.bench.gateway_report import percentile_with_lost

    done = [float(t) for t in range(1, 200)]
    assert percentile_with_lost(done, 0, 99) == pytest.approx(197.02)
    assert percentile_with_lost(done, 2, 99) == pytest.approx(199.0)  # the worst done one
    assert math.isinf(percentile_with_lost(done, 3, 99))  # the p99 falls among the lost
    assert math.isinf(percentile_with_lost([], 3, 50))
    assert math.isnan(percentile_with_lost([], 0, 99))


class _Spinner(ManagedProcess):
    """A process that burns CPU until stopped (no health endpoint: launched, never started)."""

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", "while True: pass"], dict(os.environ)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_cpu_readings_count_what_the_processes_used_per_request(tmp_path: Path) -> None:
    spinner = _Spinner("spinner", tmp_path, 5.0)
    assert spinner.cpu_seconds() is None  # not running
    spinner.launch()
    pid = spinner.pid
    assert pid is not None

    def reading() -> CpuReading:
        # Paused, the spinner's CPU time holds still, so reading it as router and as worker
        # gives one figure (running, the two reads could straddle a clock tick).
        os.kill(pid, signal.SIGSTOP)
        try:
            return CpuReading.of([spinner], [spinner])
        finally:
            os.kill(pid, signal.SIGCONT)

    try:
        before = reading()
        deadline = 10.0
        while (spinner.cpu_seconds() or 0.0) - (before.router_s or 0.0) < 0.2 and deadline > 0:
            deadline -= 0.05
            time.sleep(0.05)
        after = reading()
    finally:
        spinner.stop()
    per_request = after.per_request_ms(before, 10)
    assert per_request["router"] >= 0.2 * 1000 / 10
    assert per_request["workers"] == pytest.approx(per_request["router"])
    # A worker that restarted (another pid) is not counted; no routers, no router figure.
    moved = CpuReading(None, {pid + 1: s for pid, s in after.workers_s.items()})
    assert moved.per_request_ms(before, 10) == {}
    assert after.per_request_ms(before, 0) == {}


def test_the_clients_read_a_429s_wait_as_the_openai_sdks_do() -> None:
    import httpx

    from kvserve.bench.gateway_load import _retry_after_s

    def wait(**headers: str) -> float:
        return _retry_after_s(httpx.Headers({k.replace("_", "-"): v
                                             for k, v in headers.items()}), 1.0)

    assert wait(retry_after_ms="250", retry_after="1") == 0.25  # milliseconds first
    assert wait(retry_after="2") == 2.0
    assert wait(retry_after_ms="soon", retry_after="3") == 3.0
    assert wait(retry_after="0") == 1.0  # not a wait: the default
    assert wait(retry_after="600") == 1.0  # past 60 s: the default, as the SDKs do
    assert wait() == 1.0


@pytest.mark.parametrize("sdk_retries", [False, True])
def test_a_429_spends_a_retry_only_where_the_clients_count_it_as_the_sdks_do(
        sdk_retries: bool) -> None:
    """The OpenAI SDKs count a 429 against `max_retries` (2 by default) like a timeout: with
    `rejections_spend_retries` three 429s lose the request; without, it is sent until its
    deadline."""
    import asyncio

    import httpx

    from kvserve.bench.gateway_load import ClientPolicy, send_request

    answers: list[int] = []

    def always_busy(request: httpx.Request) -> httpx.Response:
        answers.append(429)
        return httpx.Response(429, headers={"retry-after-ms": "5"}, json={"error": "busy"})

    async def scenario() -> None:
        transport = httpx.MockTransport(always_busy)
        async with httpx.AsyncClient(transport=transport) as client:
            policy = ClientPolicy(max_retries=2, deadline_s=0.5,
                                  rejections_spend_retries=sdk_retries)
            request = GatewayRequest("r0", 0.0, "t0", "hello", 1, 1)
            result = await send_request(client, request, "m", lambda r, n: "http://w", policy)
        assert not result.ok and result.rejections == len(answers)
        if sdk_retries:
            assert result.rejections == 3 and result.error == "429 after 2 retries"
        else:
            assert result.rejections > 10 and result.error == "deadline passed"

    asyncio.run(scenario())
