"""`python -m benchmarks.gateway_keys`: what keying one prompt costs the gateway's event loop
under the `precise` policy, tokenizing every prompt in full (before) and through the tokenizer
memo (after), on `python -m benchmarks gateway`'s own workload: the same multi-tenant trace, prompt
texts and model tokenizer (`--model tiny`: the demo tokenizer its workers load).

Each pass starts a cold keyer, as a freshly started gateway has, and keys the requests in arrival
order; the two ways alternate request by request, so drift on the machine hits both alike. Every
key is compared: the memo must give the very block hashes of a full tokenization. A
microbenchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from kvserve.bench.gateway_workload import BlockTexts, gateway_requests, tenant_trace
from kvserve.gateway.core.prefix import RouteKey
from kvserve.gateway.core.route_key import route_request_for
from kvserve.gateway.core.token_keys import TokenKeyer
from kvserve.gateway.core.token_memo import MemoOutcome
from kvserve.workload import MultiTenantSpec


class FullKeyer(TokenKeyer):
    """The keyer as it was before the memo: every prompt tokenized in full."""

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gateway_keys",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, 100m or a checkpoint dir")
    p.add_argument("--tenants", type=int, default=10)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--prefix-tokens", type=_pair, default=(2048, 3072), metavar="LO,HI")
    p.add_argument("--suffix-tokens", type=_pair, default=(32, 96), metavar="LO,HI")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf tenant skew (bench's 'skew' "
                   "case: 1.2)")
    p.add_argument("--seed", type=int, default=0, help="first seed; pass i uses seed + i")
    p.add_argument("--passes", type=int, default=5, help="cold-memo passes over the workload")
    return p


def _ms(seconds: Sequence[float]) -> str:
    ordered = sorted(seconds)

    def q(f: float) -> float:
        return ordered[min(len(ordered) - 1, int(f * len(ordered)))] * 1e3

    return (f"p50 {q(0.5):6.3f}  p90 {q(0.9):6.3f}  p99 {q(0.99):6.3f}  "
            f"mean {statistics.fmean(ordered) * 1e3:6.3f} ms")


def run(args: argparse.Namespace) -> int:
    from kvserve.bench.engine_workloads import ensure_bench_model
    from kvserve.bench.serve_prompts import PromptBuilder
    from kvserve.model import Tokenizer

    model_dir = ensure_bench_model(args.model).resolve()
    texts = BlockTexts(PromptBuilder(Tokenizer.from_pretrained(model_dir)))
    spec = MultiTenantSpec(num_tenants=args.tenants, num_requests=args.requests,
                           prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                           output_tokens=16, rate_per_s=4.0, skew=args.skew, seed=args.seed)
    before: list[float] = []
    after: list[float] = []
    hashing: list[float] = []
    outcomes = dict.fromkeys(MemoOutcome, 0)
    requested = tokenized = mismatches = 0
    full = FullKeyer(model_dir)
    for i in range(args.passes):
        requests = gateway_requests(tenant_trace(replace(spec, seed=args.seed + i)), texts)
        memo = TokenKeyer(model_dir)  # cold, as a gateway that just started
        for req in requests:
            body = {"model": model_dir.name, "prompt": req.prompt}
            t0 = time.perf_counter()
            expected = route_request_for("/v1/completions", body, req.tenant, full)
            t1 = time.perf_counter()
            got = route_request_for("/v1/completions", body, req.tenant, memo)
            t2 = time.perf_counter()
            ids = full.encode(req.prompt)
            t3 = time.perf_counter()
            RouteKey.from_token_ids(ids, req.tenant, model_id=model_dir.name)
            hashing.append(time.perf_counter() - t3)
            before.append(t1 - t0)
            after.append(t2 - t1)
            mismatches += got != expected
        stats = memo.prompt_memo.stats
        for outcome, count in stats.counts.items():
            outcomes[outcome] += count
        requested += stats.chars_requested
        tokenized += stats.chars_tokenized
    num = len(after)
    print(f"{args.passes} passes x {args.requests} requests, {args.tenants} tenants, prefixes "
          f"{args.prefix_tokens[0]}-{args.prefix_tokens[1]} tokens, suffixes "
          f"{args.suffix_tokens[0]}-{args.suffix_tokens[1]}, skew {args.skew:g}, model "
          f"{model_dir.name}; key = tokenize + block hashes, per request")
    print(f"  before (full tokenization): {_ms(before)}")
    print(f"  after  (tokenizer memo):    {_ms(after)}")
    print(f"  of which block hashes:      {_ms(hashing)}")
    print("  memo outcomes: " + ", ".join(f"{o.value} {n} ({n / num:.1%})"
                                          for o, n in outcomes.items()))
    print(f"  characters tokenized: {tokenized / max(requested, 1):.1%} of those keyed; "
          f"keys differing from a full tokenization's: {mismatches}")
    return 1 if mismatches else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
