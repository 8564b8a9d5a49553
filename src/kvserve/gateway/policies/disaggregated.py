"""Disaggregated routing: a prefill worker chosen by prefix, a decode worker chosen by load.

Pure like every policy: the prompt's KV is computed on the prefill worker the configured prefix
policy picks among the prefill pool (so a prefix keeps landing where its blocks are cached), and
the request is decoded on the decode worker `least_load` picks among the decode pool (decodes are
long and steady; their placement is a load-balancing problem).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvserve.gateway.policies.base import RouteDecision, RouteRequest, RoutingPolicy, WorkerView


@dataclass(frozen=True, slots=True)
class SplitDecision:
    """Where a request's prompt is prefilled and where it is decoded (each with its ranking)."""

    prefill: RouteDecision
    decode: RouteDecision


class DisaggregatedRouter:
    """`prefill_policy` over the workers in `prefill_ids`, `decode_policy` over `decode_ids`.
    The two pools must not overlap (a worker has one role)."""

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
        self.prefill_ids = frozenset(prefill_ids)
        self.decode_ids = frozenset(decode_ids)

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> SplitDecision:
        """Both choices; raises NoHealthyWorker when either pool has no healthy worker."""
        prefill = self.prefill_policy.route(
            request, [w for w in workers if w.worker_id in self.prefill_ids])
        decode = self.decode_policy.route(
            request, [w for w in workers if w.worker_id in self.decode_ids])
        return SplitDecision(prefill, decode)

    def observe(self, request: RouteRequest, prefill_id: str, decode_id: str) -> None:
        """The request was sent: its prompt to `prefill_id`, its decode to `decode_id`."""
        self.prefill_policy.observe(request, prefill_id)
        self.decode_policy.observe(request, decode_id)

    def role_of(self, worker_id: str) -> str:
        return "prefill" if worker_id in self.prefill_ids else (
            "decode" if worker_id in self.decode_ids else "both")
