"""The pipeline's weighted scorers, and the continuous cache-versus-load score they make up for
`cache_aware` and `precise` (`pickers.BestScore` chooses by it).

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
not by the load of the moment; unless the picker places such a prefix itself (`BestScore.cold`:
`cache_aware` by default, in rendezvous order, which its replicas share and its index does not).

The continuity is what sgl-router's cache_aware lacks: it flips between "follow the cache" and
"shortest queue" at a fixed imbalance, which gives both hot spots (below the threshold) and lost
affinity (above).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest, WorkerView
from kvserve.gateway.core.pipeline.indexes import ApproxIndex

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


class PrefixHits:
    """Cached-prefix credit: `block_credit` per leading block the worker holds."""

    def __init__(self, block_credit: float) -> None:
        self.block_credit = block_credit

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        return [hits[w.worker_id] * self.block_credit for w in workers]


class Load:
    """Outstanding requests (`WorkerView.load`), `load_weight` each."""

    def __init__(self, load_weight: float) -> None:
        self.load_weight = load_weight

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        return [-(self.load_weight * w.load) for w in workers]


class Backlog:
    """Prefill tokens queued ahead (`WorkerView.prefill_backlog_tokens`), each worth
    `backlog_weight` of a cached token (a block's `block_credit` over its tokens)."""

    def __init__(self, backlog_weight: float, block_credit: float) -> None:
        self.backlog_weight = backlog_weight
        self.block_credit = block_credit

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        per_token = self.backlog_weight * self.block_credit / request.block_tokens
        return [-(per_token * w.prefill_backlog_tokens) for w in workers]


class Footprint:
    """For a prefix no worker holds: the blocks the index believes a worker caches, against
    the fullest worker, `footprint_weight` for the fullest (a new prefix fills the emptier
    cache). Zero once some worker holds the prefix."""

    def __init__(self, footprint_weight: float, index: ApproxIndex) -> None:
        self.footprint_weight = footprint_weight
        self.index = index

    def score(self, request: RouteRequest, workers: Sequence[WorkerView],
              hits: Mapping[str, int]) -> list[float]:
        cold = max(hits.values(), default=0) == 0
        sizes = [self.index.index_size(w.worker_id) if cold else 0 for w in workers]
        fullest = max(sizes, default=0) or 1
        return [-(self.footprint_weight * size / fullest) for size in sizes]
