"""The multi-tenant agent workload: tenants whose prompts share a long prefix.

Each tenant (an analyst agent, a compliance checker, a SQL debugger, ...) sends prompts made of its
own long system prefix followed by a short unique suffix. Tenant popularity follows a Zipf law
(`skew=0` is uniform); arrivals are Poisson. The result is an ordinary `TraceRequest` list whose
`hash_ids` encode the sharing, so it replays through the same code as the Mooncake traces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.workload.trace import TRACE_BLOCK_SIZE, TraceRequest


@dataclass(frozen=True, slots=True)
class MultiTenantSpec:
    """Shape of a multi-tenant workload; the defaults are the incident's (25-30k-token prefixes)."""

    num_tenants: int = 8
    num_requests: int = 400
    prefix_tokens: tuple[int, int] = (25_000, 30_000)
    suffix_tokens: tuple[int, int] = (200, 1_000)
    output_tokens: int = 120
    rate_per_s: float = 4.0
    skew: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tenants < 1 or self.num_requests < 1:
            raise ValueError("num_tenants and num_requests must be at least 1")
        if not 0 < self.prefix_tokens[0] <= self.prefix_tokens[1]:
            raise ValueError("prefix_tokens must be a (low, high) pair with 0 < low <= high")
        if not 0 < self.suffix_tokens[0] <= self.suffix_tokens[1]:
            raise ValueError("suffix_tokens must be a (low, high) pair with 0 < low <= high")
        if self.rate_per_s <= 0 or self.skew < 0:
            raise ValueError("rate_per_s must be positive and skew non-negative")


def multi_tenant_trace(
    spec: MultiTenantSpec, block_size: int = TRACE_BLOCK_SIZE
) -> list[TraceRequest]:
    """Generate `spec.num_requests` requests, deterministic for a given spec."""
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh_ids(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    # A tenant's prefix is a whole number of blocks, so its suffix starts on a block boundary.
    prefix_blocks = [
        rng.randint(*spec.prefix_tokens) // block_size for _ in range(spec.num_tenants)
    ]
    prefix_ids = [fresh_ids(n) for n in prefix_blocks]
    weights = [1.0 / (rank + 1) ** spec.skew for rank in range(spec.num_tenants)]

    requests: list[TraceRequest] = []
    now_ms = 0.0
    for idx in range(spec.num_requests):
        now_ms += rng.expovariate(spec.rate_per_s) * 1000.0
        tenant = rng.choices(range(spec.num_tenants), weights)[0]
        suffix = rng.randint(*spec.suffix_tokens)
        suffix_ids = fresh_ids(-(-suffix // block_size))
        requests.append(
            TraceRequest(
                request_id=f"mt-{idx}",
                arrival_ms=now_ms,
                input_length=prefix_blocks[tenant] * block_size + suffix,
                output_length=spec.output_tokens,
                hash_ids=tuple(prefix_ids[tenant] + suffix_ids),
                tenant=f"tenant-{tenant}",
            )
        )
    return requests
