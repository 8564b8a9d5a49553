"""The continuous cache-versus-load score shared by `cache_aware` and `precise`.

score(worker) = matched_blocks * block_credit - load_weight * load - backlog_weight * backlog
score(worker) = -load_weight * load - backlog_weight * backlog
                - footprint_weight * footprint / largest footprint
                (when no worker holds any of the prefix)

`backlog` is the worker's prefill backlog (`WorkerView.prefill_backlog_tokens`) in blocks of the
request's key, weighed against the cached-prefix credit (`backlog_weight * block_credit` a
block): tokens a cached prefix saves against tokens of other prompts' prefill queued ahead.

One formula for every worker and every load, no threshold: as a worker's load grows, its cached
prefix is outweighed smoothly, at a point that scales with how much of the prompt it holds. The
footprint (what the policy believes a worker caches, relative to the fullest worker) decides where
a prefix nobody holds goes: where there is most room, so whole tenants spread by cache footprint,
not by the load of the moment; unless the caller places such a prefix itself (`place_cold`:
`cache_aware` by default, in rendezvous order, which its replicas share and its index does not).

The continuity is what sgl-router's cache_aware lacks: it flips between "follow the cache" and
"shortest queue" at a fixed imbalance, which gives both hot spots (below the threshold) and lost
affinity (above).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.gateway.policies.base import Branch, RouteDecision, RouteRequest, WorkerView
from kvserve.gateway.policies.rendezvous import rendezvous_key, rendezvous_order

DEFAULT_BLOCK_CREDIT = 1.0
DEFAULT_LOAD_WEIGHT = 1.0
"""One outstanding request outweighs one cached block (64 tokens in character blocks, 16 in
token blocks): a prefix of a few thousand tokens keeps its worker through a queue of dozens of
requests, a one-block prefix does not. Stickier weights spill long prefixes in bursts and so
copy tenants into a second cache (docs/operations.md, "Routing and admission options")."""

DEFAULT_FOOTPRINT_WEIGHT = 16 * DEFAULT_LOAD_WEIGHT
"""An empty worker against the fullest one counts as sixteen requests of load: a new prefix
fills the emptier cache unless that worker is far busier. Weaker, a hot tenant's worker (always
the busier one) pushes every new tenant to the other worker until its cache overflows."""


DEFAULT_BACKLOG_WEIGHT = 0.25
"""A token of prefill queued ahead costs a quarter of a cached token: a request leaves its cached
prefix only for a worker whose backlog is shorter by four times that prefix (it would wait less,
but the move copies the prefix into a second cache, and that costs hits later); a prefix nobody
holds avoids a worker busy with a cold prefill. At 0 the score is the request-count load
alone."""


def check_weights(block_credit: float, load_weight: float, footprint_weight: float = 0.0,
                  backlog_weight: float = 0.0) -> None:
    """Raise ValueError unless `block_credit` and `load_weight` are positive and finite and
    `footprint_weight` and `backlog_weight` are >= 0 and finite."""
    for name, value in (("block_credit", block_credit), ("load_weight", load_weight)):
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value}")
    for name, value in (("footprint_weight", footprint_weight),
                        ("backlog_weight", backlog_weight)):
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"{name} must be >= 0 and finite, got {value}")


def score_route(
    request: RouteRequest,
    healthy: Sequence[WorkerView],
    num_matched: Callable[[str], int],
    *,
    block_credit: float,
    load_weight: float,
    prefix_blocks: int,
    hit_branch: Branch,
    footprint: Callable[[str], int] | None = None,
    footprint_weight: float = 0.0,
    backlog_weight: float = 0.0,
    place_cold: Callable[[RouteRequest, Sequence[WorkerView]], RouteDecision] | None = None,
) -> RouteDecision:
    """Rank healthy workers by score (ties in the prefix's rendezvous order, so a prefix nobody
    caches lands where `prefix_hash` would put it) and choose the best. Branch: `hit_branch`
    when the chosen worker holds the longest cached prefix, SPILL when another holds more,
    LEAST_LOAD when none holds any. `num_matched(worker_id)` and `footprint(worker_id)` (blocks
    the policy believes the worker caches) must not change any index. `place_cold`: when given,
    it chooses for a prefix nobody holds (branch LEAST_LOAD, no predicted hit) instead of the
    footprint and load terms."""
    # Invariant: the choice maximises the one continuous score; no branch is a separate rule
    # (but for a prefix nobody holds, when the caller places it: `place_cold`).
    key = rendezvous_key(request.tenant, request.prefix_hashes, prefix_blocks)
    order = rendezvous_order(key, healthy)
    matched = {w.worker_id: num_matched(w.worker_id) for w in order}
    best = max(matched.values())
    if best == 0 and place_cold is not None:
        cold = place_cold(request, order)
        return RouteDecision(cold.worker_id, Branch.LEAST_LOAD, cold.ranked, 0)
    sizes = {w.worker_id: footprint(w.worker_id) if footprint and best == 0 else 0
             for w in order}
    fullest = max(sizes.values(), default=0) or 1

    backlog_per_token = backlog_weight * block_credit / request.block_tokens  # a cached token's

    def score(worker: WorkerView) -> float:
        wid = worker.worker_id
        return (matched[wid] * block_credit - load_weight * worker.load
                - backlog_per_token * worker.prefill_backlog_tokens
                - footprint_weight * sizes[wid] / fullest)

    ranked = sorted(order, key=score, reverse=True)  # stable: ties keep the rendezvous order
    chosen = ranked[0].worker_id
    if best == 0:
        branch = Branch.LEAST_LOAD
    elif matched[chosen] == best:
        branch = hit_branch
    else:
        branch = Branch.SPILL
    return RouteDecision(chosen, branch, tuple(w.worker_id for w in ranked), matched[chosen])
