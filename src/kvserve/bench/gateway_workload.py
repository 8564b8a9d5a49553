"""The multi-tenant workload of `kvserve bench gateway`, as text prompts.

Requests come from kvserve.workload's multi-tenant generator (tenants with long private prefixes,
short unique suffixes, Poisson arrivals, Zipf tenant skew), so the very same `TraceRequest` list
can be replayed by the simulator (`--calibrate`). Each 512-token content block of the trace
(`hash_ids[i]`) becomes 512 whole-word tokens of the model's vocabulary drawn from a seed that
is the content id, so two prompts share a text prefix exactly when they share content blocks, and
the worker's tokenizer turns a prompt back into `input_length` tokens (plus its BOS). Text, not
token ids: SGLang's router only accepts text.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.serve_prompts import PromptBuilder
from kvserve.workload import TRACE_BLOCK_SIZE, MultiTenantSpec, TraceRequest, multi_tenant_trace


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """One request the clients send: when (seconds after the start), for whom, and what."""

    request_id: str
    arrival_s: float
    tenant: str
    prompt: str
    prompt_tokens: int  # as the trace says, without the server's BOS
    max_tokens: int
    model: str | None = None  # the `model` it names (its tenant's adapter); None: the run's


class BlockTexts:
    """Text of each trace content block: TRACE_BLOCK_SIZE single-token words, memoised."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.words = builder.words
        self._memo: dict[int, list[str]] = {}

    def chars_per_token(self) -> float:
        """Mean characters per word token (to size the gateway's character blocks in tokens)."""
        return sum(map(len, self.words)) / len(self.words)

    def words_of(self, content_id: int) -> list[str]:
        words = self._memo.get(content_id)
        if words is None:
            rng = random.Random(f"bench-gateway/block/{content_id}")
            words = self._memo[content_id] = [rng.choice(self.words)
                                              for _ in range(TRACE_BLOCK_SIZE)]
        return words

    def prompt(self, request: TraceRequest) -> str:
        """`request.input_length` words: its content blocks, then unique filler if short."""
        words: list[str] = []
        for content_id in request.hash_ids:
            words.extend(self.words_of(content_id))
            if len(words) >= request.input_length:
                break
        if len(words) < request.input_length:
            rng = random.Random(f"bench-gateway/filler/{request.request_id}")
            words.extend(rng.choice(self.words) for _ in range(request.input_length - len(words)))
        return "".join(words[: request.input_length])


def gateway_requests(trace: Sequence[TraceRequest], texts: BlockTexts,
                     model_of: Callable[[str], str] | None = None) -> list[GatewayRequest]:
    """The trace as text requests, arrival times relative to the first arrival; with
    `model_of`, each names `model_of(its tenant)` as its model (a LoRA adapter)."""
    if not trace:
        return []
    t0 = trace[0].arrival_ms
    out = []
    for r in trace:
        tenant = r.tenant or "default"
        out.append(GatewayRequest(r.request_id, (r.arrival_ms - t0) / 1000.0, tenant,
                                  texts.prompt(r), r.input_length, r.output_length,
                                  model_of(tenant) if model_of is not None else None))
    return out


def tenant_trace(spec: MultiTenantSpec) -> list[TraceRequest]:
    """The generator's requests for `spec`, in arrival order."""
    return sorted(multi_tenant_trace(spec), key=lambda r: r.arrival_ms)


def ideal_assignment(requests: Sequence[GatewayRequest], num_workers: int,
                     group_of: Callable[[str], str] | None = None) -> dict[str, int]:
    """The client-side "ideal" split, the hit-rate ceiling: every tenant pinned to one worker,
    tenants placed largest prefix first on the worker with the least prefix assigned so far
    (LPT on cache footprint), so each worker caches only its own tenants' prefixes and the
    prefixes are spread as evenly as whole tenants allow. A tenant's footprint is its shortest
    prompt (its prefix plus the shortest suffix). Traffic is not balanced: under a skewed mix
    the hot tenant's worker is busier, which costs TTFT, not hits. With `group_of` (a tenant's
    LoRA adapter), whole groups are pinned alike, their footprint summed, so every adapter
    loads on one worker only (tenants of different adapters share no prefix, so the hit-rate
    ceiling is unchanged while the groups balance)."""
    if num_workers < 1:
        raise ValueError("num_workers must be at least 1")
    footprint: dict[str, int] = {}
    for r in requests:
        footprint[r.tenant] = min(footprint.get(r.tenant, r.prompt_tokens), r.prompt_tokens)
    groups: dict[str, list[str]] = {}
    for tenant in footprint:
        groups.setdefault(group_of(tenant) if group_of is not None else tenant, []).append(tenant)
    size = {g: sum(footprint[t] for t in members) for g, members in groups.items()}
    loads = [0] * num_workers
    assignment: dict[str, int] = {}
    for group in sorted(groups, key=lambda g: (-size[g], g)):
        worker = min(range(num_workers), key=lambda w: (loads[w], w))
        assignment.update((tenant, worker) for tenant in groups[group])
        loads[worker] += size[group]
    return assignment


def working_set_tokens(trace: Sequence[TraceRequest]) -> int:
    """Tokens of the content blocks that more than one request reads: the shared prefixes,
    i.e. what a cache must hold for every repeat visit to hit."""
    tokens: dict[int, int] = {}
    readers: dict[int, int] = {}
    for r in trace:
        for i, content_id in enumerate(r.hash_ids):
            take = min(TRACE_BLOCK_SIZE, r.input_length - i * TRACE_BLOCK_SIZE)
            if take > 0:
                tokens[content_id] = max(tokens.get(content_id, 0), take)
                readers[content_id] = readers.get(content_id, 0) + 1
    return sum(n for cid, n in tokens.items() if readers[cid] > 1)


def token_range(text: str) -> tuple[int, int]:
    """`LO,HI` (or one number for both) as a pair of token counts."""
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def add_workload_arguments(group: argparse._ArgumentGroup) -> None:
    """The multi-tenant workload's flags, as `spec_from_args` reads them."""
    group.add_argument("--tenants", type=int, default=10)
    group.add_argument("--requests", type=int, default=160,
                       help="requests per run (of each router)")
    group.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    group.add_argument("--prefix-tokens", type=token_range, default=(2048, 3072),
                       metavar="LO,HI")
    group.add_argument("--suffix-tokens", type=token_range, default=(32, 96), metavar="LO,HI")
    group.add_argument("--output-tokens", type=int, default=16)
    group.add_argument("--seed", type=int, default=0)


def spec_from_args(args: argparse.Namespace) -> MultiTenantSpec:
    """The multi-tenant workload of the gateway benchmarks' shared flags (--tenants, --requests,
    --prefix-tokens, --suffix-tokens, --output-tokens, --rate, --seed), unskewed."""
    return MultiTenantSpec(num_tenants=args.tenants, num_requests=args.requests,
                           prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                           output_tokens=args.output_tokens, rate_per_s=args.rate, skew=0.0,
                           seed=args.seed)


def bench_model_prompts(model: str) -> tuple[Path, PromptBuilder]:
    """The bench model's directory (made if missing) and a prompt builder in its tokenizer."""
    from kvserve.bench.engine_workloads import ensure_bench_model
    from kvserve.model import Tokenizer

    model_dir = ensure_bench_model(model).resolve()
    return model_dir, PromptBuilder(Tokenizer.from_pretrained(model_dir))


def kv_bytes_per_token(model_dir: Path) -> int:
    """float32 K and V of every layer for one token, as a local worker sizes its cache."""
    import torch

    from kvserve.model import kv_cache_bytes_per_block, read_model_config, resolve_model_path

    config = read_model_config(resolve_model_path(model_dir))  # config.json or a GGUF's
    return kv_cache_bytes_per_block(config, 1, torch.float32)
