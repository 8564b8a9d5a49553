"""The continuous cache-versus-load score shared by `cache_aware` and `precise`.

score(worker) = matched_blocks * block_credit - load_weight * load

One formula for every worker and every load, no threshold: as a worker's load grows, its cached
prefix is outweighed smoothly, at a point that scales with how much of the prompt it holds. This
is what sgl-router's cache_aware lacks: it flips between "follow the cache" and "shortest queue"
at a fixed imbalance, which gives both hot spots (below the threshold) and lost affinity (above).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.gateway.policies.base import Branch, RouteDecision, RouteRequest, WorkerView
from kvserve.gateway.policies.rendezvous import rendezvous_key, rendezvous_order

DEFAULT_BLOCK_CREDIT = 1.0
DEFAULT_LOAD_WEIGHT = 8.0
"""One outstanding request outweighs 8 cached blocks (about 512 tokens in character blocks, 128
in token blocks): a long shared prefix keeps its worker through a queue of several requests, a
short one does not. Tune with the simulator."""


def check_weights(block_credit: float, load_weight: float) -> None:
    """Raise ValueError unless both weights are positive and finite."""
    for name, value in (("block_credit", block_credit), ("load_weight", load_weight)):
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value}")


def score_route(
    request: RouteRequest,
    healthy: Sequence[WorkerView],
    num_matched: Callable[[str], int],
    *,
    block_credit: float,
    load_weight: float,
    prefix_blocks: int,
    hit_branch: Branch,
) -> RouteDecision:
    """Rank healthy workers by score (ties in the prefix's rendezvous order, so a prefix nobody
    caches lands where `prefix_hash` would put it) and choose the best. Branch: `hit_branch`
    when the chosen worker holds the longest cached prefix, SPILL when another holds more,
    LEAST_LOAD when none holds any. `num_matched(worker_id)` must not change any index."""
    # Invariant: the choice maximises the one continuous score; no branch is a separate rule.
    key = rendezvous_key(request.tenant, request.prefix_hashes, prefix_blocks)
    order = rendezvous_order(key, healthy)
    matched = {w.worker_id: num_matched(w.worker_id) for w in order}

    def score(worker: WorkerView) -> float:
        return matched[worker.worker_id] * block_credit - load_weight * worker.load

    ranked = sorted(order, key=score, reverse=True)  # stable: ties keep the rendezvous order
    chosen = ranked[0].worker_id
    best = max(matched.values())
    if best == 0:
        branch = Branch.LEAST_LOAD
    elif matched[chosen] == best:
        branch = hit_branch
    else:
        branch = Branch.SPILL
    return RouteDecision(chosen, branch, tuple(w.worker_id for w in ranked), matched[chosen])
