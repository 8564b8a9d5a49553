"""One request's dispatch, as every front end drives it: pick -> sent -> answered (the worker's
response headers) -> first byte -> closed (done, failed or cancelled).

The proxy (`proxy.forward.Forwarder`, `proxy.endpoint`), the Endpoint Picker (`epp.exchange`)
and the simulator (`sim.gateway`) each move bytes their own way, but the bookkeeping a request
leaves behind is this one object's: the worker's in-flight count from the moment the request is sent
(not when it answers: a burst of one prefix arriving meanwhile must see where it went), the
policy's index (`observe`), the prefill backlog of uncached prompt tokens until the answer
starts, first-byte lateness for admission's latency limit, and the metrics. Pure: the caller
passes the time; the per-worker counts live behind `Ledger` (the gateway's worker pool, or the
simulator's tables).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from kvserve.gateway.core.latency_limit import is_late
from kvserve.gateway.core.pipeline.base import RouteDecision, RouteRequest, WorkerView

FAILOVER = "failover"
"""The metrics branch of a request answered by a worker other than the one picked."""


class Router(Protocol):
    """What a dispatch routes with: a routing policy or pipeline (`policies`)."""

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """Choose; raises NoHealthyWorker; changes no index."""
        ...

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The request was sent to `worker_id`."""
        ...


class Hold(Protocol):
    """The request's admission slot (`admission.Slot`, or the simulator's ticket)."""

    def first_byte(self, late: bool, answer_s: float | None = None) -> None: ...

    def gave_up(self, waited_s: float | None = None) -> None: ...

    def release(self) -> None: ...


class Ledger(ABC):
    """Per-worker counts a dispatch keeps, and the metrics it reports. The counts are the
    subclass's to store (one that does not cannot be built); the `record_*` hooks do nothing
    unless overridden (the simulator keeps no metrics or health)."""

    @abstractmethod
    def count_sent(self, worker_id: str) -> None:
        """A request is now open on the worker (in flight + 1)."""

    @abstractmethod
    def count_ended(self, worker_id: str, finished: bool) -> None:
        """A request open on the worker ended (in flight - 1); `finished`: its answer was read
        to the end or never started, else the worker may count it until it sees the
        disconnect."""

    @abstractmethod
    def add_backlog(self, worker_id: str, tokens: int) -> None:
        """Prompt tokens of prefill ahead on the worker (negative: handed back)."""

    def record_added_latency(self, seconds: float) -> None:
        """From arrival to the first send: what the gateway itself added."""
        return

    def record_routed(self, worker_id: str, branch: str) -> None:
        """A decision counted by branch (a prefill worker's, at pick time)."""
        return

    def record_answer(self, worker_id: str, branch: str, predicted_hit_blocks: int) -> None:
        """The worker answered (not with backpressure)."""
        return

    def record_backpressure(self, worker_id: str) -> None:
        """The worker answered 429/503."""
        return

    def record_retry(self, reason: str) -> None:
        """The request is sent again, to another worker."""
        return


class Dispatch:
    """One admitted request's way through the fleet. `pick` once, then per attempt `send` and
    either `answered` or `failed`; `first_byte` when the client's answer starts; `end` when
    the upstream request is over and `release` when the admission slot goes (`close`: both).
    Every step is idempotent where a front end may reach it twice (`end`, `release`)."""

    __slots__ = (
        "_backlog",
        "_hold_released",
        "_prefill_id",
        "admitted",
        "answered",
        "deadline",
        "decision",
        "hold",
        "ledger",
        "num_sent",
        "route",
        "router",
        "started",
        "ttft_target_s",
        "worker_id",
    )

    def __init__(self, router: Router, ledger: Ledger, route: RouteRequest, *, started: float,
                 admitted: float, deadline: float | None = None,
                 ttft_target_s: float | None = None, hold: Hold | None = None) -> None:
        self.router = router
        self.ledger = ledger
        self.route = route
        self.started = started  # arrival
        self.admitted = admitted  # admission let it through: upstream time counts from here
        self.deadline = deadline  # the client's, on the same clock; None: it said nothing
        self.ttft_target_s = ttft_target_s
        self.hold = hold
        self.decision: RouteDecision | None = None
        self.worker_id: str | None = None  # holds this request's in-flight count
        self.num_sent = 0
        self.answered = False  # its first byte went to the client (or the gateway answered)
        self._prefill_id: str | None = None  # a prefill worker busy until the answer starts
        self._backlog: tuple[str, int] | None = None
        self._hold_released = False

    def pick(self, views: Sequence[WorkerView]) -> RouteDecision:
        """Route (raises NoHealthyWorker); counts nothing until `send`."""
        decision = self.decision = self.router.route(self.route, views)
        if decision.prefill is not None:
            self.ledger.record_routed(decision.prefill.worker_id,
                                      f"prefill_{decision.prefill.branch}")
        return decision

    def candidates(self) -> list[str]:
        """Workers to try in order: the pick, then its fallbacks."""
        assert self.decision is not None, "pick first"
        return [self.decision.worker_id, *(w for w in self.decision.ranked
                                           if w != self.decision.worker_id)]

    def send(self, worker_id: str, now: float, retry_reason: str | None = None) -> None:
        """The request goes to `worker_id` now (`retry_reason`: why an earlier attempt did
        not do; the metrics' label)."""
        # Invariant: at most one attempt holds counts; each send is matched by one
        # answered/failed (backlog, prefill) and one end or failed (in flight).
        decision = self.decision
        assert decision is not None and self.worker_id is None, "pick, and end the last attempt"
        if retry_reason is not None:
            self.ledger.record_retry(retry_reason)
        picked = worker_id == decision.worker_id
        self.num_sent += 1
        self.worker_id = worker_id
        self.ledger.count_sent(worker_id)
        self.router.observe(self.route, worker_id)
        if picked:
            self.ledger.record_added_latency(now - self.started)
        prefill = decision.prefill
        if prefill is not None:  # busy with it until the decode worker answers
            self._prefill_id = prefill.worker_id
            self.ledger.count_sent(prefill.worker_id)
            self.router.observe(self.route, prefill.worker_id)
        # The prompt's prefill is work ahead of later requests on the worker computing it,
        # until its first byte. A failover goes where nothing was predicted: the whole prompt.
        computing, hits = ((prefill.worker_id, prefill.predicted_hit_blocks) if prefill
                           else (worker_id, decision.predicted_hit_blocks if picked else 0))
        tokens = self.route.uncached_tokens(hits)
        self.ledger.add_backlog(computing, tokens)
        self._backlog = (computing, tokens)

    def answered_by(self, status: int) -> bool:
        """The worker's response headers arrived with `status`: the prefill is done. Returns
        whether it was backpressure (429/503), which the caller may fail over from."""
        worker_id, decision = self.worker_id, self.decision
        assert worker_id is not None and decision is not None, "send first"
        self._prefill_done()
        if status in BACKPRESSURE:
            self.ledger.record_backpressure(worker_id)
            return True
        picked = worker_id == decision.worker_id
        self.ledger.record_answer(worker_id, str(decision.branch) if picked else FAILOVER,
                                  decision.predicted_hit_blocks if picked else 0)
        return False

    def failed(self) -> None:
        """The attempt is over without an answer to relay (unreachable, or backpressure that
        the caller fails over from): its counts return, and the next `send` may go on."""
        self._prefill_done()
        self.end(finished=True)

    def predicted_cached_tokens(self) -> int | None:
        """Prompt tokens the policy expected the answering worker to serve from its cache;
        None where it made no prediction for it (a failover, or a disaggregated pick)."""
        decision = self.decision
        if decision is None or self.worker_id != decision.worker_id or decision.prefill:
            return None
        return min(self.route.num_tokens, decision.predicted_hit_blocks * self.route.block_tokens)

    def first_byte(self, now: float) -> None:
        """The client's answer started at `now` (or the gateway gave up waiting): tell
        admission whether it came in time (`latency_limit.is_late`). Once."""
        if self.answered:
            return
        self.answered = True
        if self.hold is not None:
            self.hold.first_byte(self.is_late(now), now - self.admitted)

    def is_late(self, now: float) -> bool:
        """Whether a first byte at `now` is late: the workers' time from admission against
        the client's time left at admission and the operator's target."""
        left = None if self.deadline is None else self.deadline - self.admitted
        return is_late(now - self.admitted, left, self.ttft_target_s)

    def end(self, finished: bool) -> None:
        """The upstream request is over (`Ledger.count_ended`'s `finished`). Idempotent."""
        self._prefill_done()
        if self.worker_id is not None:
            self.ledger.count_ended(self.worker_id, finished)
            self.worker_id = None

    def release(self, now: float, client_left: bool = False) -> None:
        """The admission slot goes back; `client_left` before a first byte tells admission
        the fleet answered too slowly for it. Idempotent."""
        if self._hold_released or self.hold is None:
            return
        self._hold_released = True
        if client_left and not self.answered:
            self.hold.gave_up(now - self.admitted)
        self.hold.release()

    def close(self, now: float, finished: bool, client_left: bool = False) -> None:
        """`end` and `release`: however the request ended."""
        self.end(finished)
        self.release(now, client_left)

    def _prefill_done(self) -> None:
        if self._backlog is not None:
            computing, tokens = self._backlog
            self.ledger.add_backlog(computing, -tokens)
            self._backlog = None
        if self._prefill_id is not None:
            self.ledger.count_ended(self._prefill_id, finished=True)
            self._prefill_id = None


BACKPRESSURE = (429, 503)
"""A worker's answers that mean "busy", never a failure."""
