"""What the simulated clients send: a trace or the multi-tenant generator, and its route keys.

Route keys are what the gateway hashes from a request's token ids (`RouteKey.from_token_ids`:
chained, tenant-salted sha256 block hashes; the gateway's own test pins them equal to
kvserve.kvcache's chain). A trace's tokens are a pure function of its 512-token content blocks
(`prompt_token_ids`), so the hashes of the route blocks inside one content block depend only on
(tenant, parent hash, content id): `RouteKeys` memoises them per content block, which makes
keying an hour of Mooncake traffic cheap, and computes the rest (partial blocks, unique filler)
directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.engine.lora import AdapterRef
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.prefix import ROOT_HASH, engine_extra_keys
from kvserve.kvcache.hashing import TOKEN_WIDTH, chain_hashes, encode_tokens
from kvserve.workload import (
    TRACE_BLOCK_SIZE,
    MultiTenantSpec,
    TraceRequest,
    load_trace,
    multi_tenant_trace,
)

MULTI_TENANT = "multi-tenant"
"""The `--trace` value that selects the multi-tenant generator."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order, and where they came from (for reports)."""

    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_ms / 1000.0 if self.requests else 0.0


def load_workload(
    trace: str,
    *,
    limit: int | None = None,
    rate_scale: float = 1.0,
    spec: MultiTenantSpec | None = None,
) -> Workload:
    """The trace at `trace` (Mooncake .jsonl or Azure .csv) or, for `MULTI_TENANT`, the
    generator's requests for `spec`. `rate_scale` > 1 compresses arrival times (more load).
    Raises TraceFormatError / ValueError with a message for the user."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    if trace == MULTI_TENANT:
        requests = multi_tenant_trace(spec or MultiTenantSpec())[:limit]
        name = MULTI_TENANT
    else:
        requests = load_trace(trace, limit)
        name = Path(trace).stem
    if rate_scale != 1.0:
        requests = [replace(r, arrival_ms=r.arrival_ms / rate_scale) for r in requests]
    ordered = sorted(requests, key=lambda r: r.arrival_ms)  # stable: ties keep file order
    return Workload(name, tuple(ordered))


class RouteKeys:
    """`RouteRequest`s for trace requests, equal to
    `RouteRequest.from_key(RouteKey.from_token_ids(tokens, tenant, block_tokens=...))`.
    Content blocks are memoised when `block_tokens` divides the trace's block size."""

    def __init__(self, block_tokens: int, model_id: str = "") -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.model_id = model_id
        self._memo: dict[tuple[str | None, bytes | None, bytes, int], tuple[bytes, ...]] = {}
        self._memoise = TRACE_BLOCK_SIZE % block_tokens == 0

    def route_request(self, request: TraceRequest, token_ids: Sequence[int],
                      adapter: AdapterRef | None = None) -> RouteRequest:
        """The request's route key under its LoRA `adapter` (its digest in the first block, as
        the worker keys it; None: the base model); `token_ids` must be
        `prompt_token_ids(request)`."""
        bs = self.block_tokens
        tenant = request.tenant
        digest = adapter.digest if adapter is not None else None
        hashes: list[bytes] = []
        parent = ROOT_HASH
        done = 0  # tokens covered by `hashes`
        if self._memoise:
            for idx, content_id in enumerate(request.hash_ids):
                end = (idx + 1) * TRACE_BLOCK_SIZE
                if end > len(token_ids):
                    break
                key = (tenant, digest, parent, content_id)
                block = self._memo.get(key)
                if block is None:
                    block = self._memo[key] = self._chain(parent, token_ids[done:end], tenant,
                                                          digest, first=done == 0)
                hashes.extend(block)
                parent, done = block[-1], end
        full = done + (len(token_ids) - done) // bs * bs
        if full > done:
            hashes.extend(self._chain(parent, token_ids[done:full], tenant, digest,
                                      first=done == 0))
        return RouteRequest(tuple(hashes), tenant, len(token_ids), bs,
                            adapter.name if adapter is not None else None)

    def _chain(self, parent: bytes, token_ids: Sequence[int], tenant: str | None,
               digest: bytes | None, first: bool) -> tuple[bytes, ...]:
        extra = engine_extra_keys(self.model_id, digest, tenant) if first else None
        hashes, _ = chain_hashes(parent, encode_tokens(token_ids),
                                 self.block_tokens * TOKEN_WIDTH, extra)
        return tuple(hashes)
