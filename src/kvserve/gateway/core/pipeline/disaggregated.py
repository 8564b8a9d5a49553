"""Disaggregated routing: a prefill worker chosen by prefix, a decode worker chosen by load.

Pure like every policy: the prompt's KV is computed on the prefill worker the configured prefix
policy picks among the prefill pool (so a prefix keeps landing where its blocks are cached), and
the request is decoded on the decode worker `least_load` picks among the decode pool (decodes are
long and steady; their placement is a load-balancing problem).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvserve.gateway.core.pipeline.base import (
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
)
from kvserve.gateway.core.pipeline.filters import Role


class DisaggregatedRouter:
    """The disaggregation stage: `prefill_policy` behind a role filter of `prefill_ids`,
    `decode_policy` behind one of `decode_ids`; its decision is the decode worker's, carrying
    the prefill worker's (`RouteDecision.prefill`), so the dispatch lifecycle and the
    forwarder handle it as any other. The two pools must not overlap (a worker has one
    role)."""

    def __init__(self, prefill_policy: RoutingPolicy, decode_policy: RoutingPolicy,
                 prefill_ids: Collection[str], decode_ids: Collection[str]) -> None:
        if not prefill_ids or not decode_ids:
            raise ValueError("disaggregated mode needs at least one prefill and one decode "
                             "worker (--prefill-worker URL --decode-worker URL)")
        both = set(prefill_ids) & set(decode_ids)
        if both:
            raise ValueError(f"a worker cannot be both a prefill and a decode worker: "
                             f"{sorted(both)}")
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self._prefill, self._decode = Role(prefill_ids), Role(decode_ids)
        self.prefill_ids = self._prefill.worker_ids
        self.decode_ids = self._decode.worker_ids

    @property
    def name(self) -> str:
        return self.prefill_policy.name

    @property
    def replica_safe(self) -> bool:
        return self.prefill_policy.replica_safe and self.decode_policy.replica_safe

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """The decode worker's decision, carrying the prefill worker's (`prefill`); raises
        NoHealthyWorker when either pool has no healthy worker."""
        prefill = self.prefill_policy.route(request, self._prefill.filter(request, workers))
        decode = self.decode_policy.route(request, self._decode.filter(request, workers))
        return RouteDecision(decode.worker_id, decode.branch, decode.ranked,
                             decode.predicted_hit_blocks, prefill)

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The request was sent to `worker_id`: its pool's policy learns it."""
        if worker_id in self.prefill_ids:
            self.prefill_policy.observe(request, worker_id)
        elif worker_id in self.decode_ids:
            self.decode_policy.observe(request, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self.prefill_policy.remove_worker(worker_id)
        self.decode_policy.remove_worker(worker_id)

    def role_of(self, worker_id: str) -> str:
        return "prefill" if worker_id in self.prefill_ids else (
            "decode" if worker_id in self.decode_ids else "both")
