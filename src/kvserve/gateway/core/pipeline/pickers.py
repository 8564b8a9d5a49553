"""Pipeline pickers: the last stage, which chooses among the ordered, scored candidates and says
why (`Branch`) and in what order to fall back."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from kvserve.gateway.core.pipeline.base import Branch, RouteDecision, RouteRequest, WorkerView
from kvserve.gateway.core.pipeline.indexes import ApproxIndex
from kvserve.gateway.core.pipeline.pipeline import Picker


class Rotation:
    """Each call takes the next candidate in id order (round robin); the rest follow in
    rotation as fallbacks. Replicas behind a balancer each keep their own counter."""

    def __init__(self) -> None:
        self.num_routed = 0

    def pick(self, request: RouteRequest, workers: list[WorkerView], hits: Mapping[str, int],
             scores: Sequence[float]) -> RouteDecision:
        start = self.num_routed % len(workers)
        self.num_routed += 1
        ranked = tuple(w.worker_id for w in workers[start:] + workers[:start])
        return RouteDecision(ranked[0], Branch.ROUND_ROBIN, ranked)


def _by_load(worker: WorkerView) -> tuple[int, str]:
    return worker.load, worker.worker_id


class TwoChoices:
    """Power of two choices (Mitzenmacher): the less loaded of two random candidates, nearly
    the balance of a full scan without every replica herding onto the same idle worker.
    Fallbacks: the other, then the rest by load; ties to the lower load, then the lower id."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, request: RouteRequest, workers: list[WorkerView], hits: Mapping[str, int],
             scores: Sequence[float]) -> RouteDecision:
        if len(workers) == 1:
            return RouteDecision(workers[0].worker_id, Branch.LEAST_LOAD, (workers[0].worker_id,))
        pair = sorted(self.rng.sample(workers, 2), key=_by_load)
        chosen_ids = {w.worker_id for w in pair}
        rest = sorted((w for w in workers if w.worker_id not in chosen_ids), key=_by_load)
        ranked = tuple(w.worker_id for w in pair + rest)
        return RouteDecision(ranked[0], Branch.LEAST_LOAD, ranked)


def load_bound(total_load: int, num_workers: int, load_factor: float) -> int:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam): a worker may take
    a new request only while its load is below ceil(c * (total_load + 1) / n). With c >= 1 some
    worker always qualifies, and the one chosen ends at or below the bound."""
    # Rounded first so that float noise (1.1 * 10 = 11.000000000000002) cannot add a slot.
    return math.ceil(round(load_factor * (total_load + 1) / num_workers, 9))


class BoundedLoad:
    """The first candidate in order (rendezvous) whose load is under `load_bound`, spilling
    down the order otherwise; fallbacks: the others under the bound, then those over it. A
    request with no full prefix block goes to the least loaded (ties in order). With `room`,
    a candidate whose index would have to evict for this chain is passed over while another
    has room (few tenants hash unevenly)."""

    def __init__(self, load_factor: float, room: ApproxIndex | None = None) -> None:
        self.load_factor = load_factor
        self.room = room

    def pick(self, request: RouteRequest, workers: list[WorkerView], hits: Mapping[str, int],
             scores: Sequence[float]) -> RouteDecision:
        # Invariant: the chosen worker's load + 1 <= load_bound(total + 1 request, n, c).
        if not request.prefix_hashes:
            order = sorted(workers, key=lambda w: w.load)  # stable: ties keep the order
            ranked = tuple(w.worker_id for w in order)
            decision = RouteDecision(ranked[0], Branch.LEAST_LOAD, ranked)
        else:
            bound = load_bound(sum(w.load for w in workers), len(workers), self.load_factor)
            under = [w.worker_id for w in workers if w.load < bound]
            over = [w.worker_id for w in workers if w.load >= bound]
            assert under, "with load_factor >= 1 some worker is always under the bound"
            branch = Branch.AFFINITY if under[0] == workers[0].worker_id else Branch.SPILL
            decision = RouteDecision(under[0], branch, tuple(under + over))
        room = self.room
        if room is None:
            return decision
        with_room = [w for w in decision.ranked if room.has_room(w, request)]
        if not with_room or with_room[0] == decision.worker_id:
            return decision
        chosen = with_room[0]
        return RouteDecision(chosen, decision.branch,
                             (chosen, *(w for w in decision.ranked if w != chosen)))


class BestScore:
    """The candidate with the highest summed score (ties keep the order). Branch:
    `hit_branch` when it holds the longest cached prefix, SPILL when another holds more,
    LEAST_LOAD when none holds any. `cold`: when given, it places a prefix no candidate
    holds (branch LEAST_LOAD, no predicted hit) instead of the scores."""

    def __init__(self, hit_branch: Branch, cold: Picker | None = None) -> None:
        self.hit_branch = hit_branch
        self.cold = cold

    def pick(self, request: RouteRequest, workers: list[WorkerView], hits: Mapping[str, int],
             scores: Sequence[float]) -> RouteDecision:
        # Invariant: the choice maximises the one continuous score; no branch is a separate
        # rule (but for a prefix nobody holds, when `cold` places it).
        best = max(hits.values(), default=0)
        if best == 0 and self.cold is not None:
            cold = self.cold.pick(request, workers, hits, scores)
            return RouteDecision(cold.worker_id, Branch.LEAST_LOAD, cold.ranked, 0)
        ranked = sorted(range(len(workers)), key=scores.__getitem__, reverse=True)  # stable
        chosen = workers[ranked[0]].worker_id
        matched = hits.get(chosen, 0)
        if best == 0:
            branch = Branch.LEAST_LOAD
        elif matched == best:
            branch = self.hit_branch
        else:
            branch = Branch.SPILL
        return RouteDecision(chosen, branch, tuple(workers[i].worker_id for i in ranked),
                             matched)
