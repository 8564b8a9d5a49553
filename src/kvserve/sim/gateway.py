"""The gateway as the simulator runs it: the real routing policy object and the gateway's own
dispatch lifecycle, fed the load signals the production gateway sees, and its admission control.

Signals: `in_flight` is the gateway's own exact count per worker (it knows what it sent), and
so is the prefill backlog (prompt tokens sent and not yet answered with a first token, less what
the policy expected cached: `core.lifecycle.Dispatch` keeps it for every front end);
`num_running`, `num_waiting` and `kv_usage` come from the last scrape of the workers' metrics,
so they are up to one scrape interval stale, as in production (gateway.scraper).
Admission is the gateway's own state machine (`gateway.admission_core`), driven from the
simulated clock: the same limits, queue order, waits and refusals, the same AIMD latency limit
with `latency_limit` (the gateway's default; it applies as the gateway applies it: only where
the workers do not declare their batch, `declared_batch=False`, as vLLM and SGLang do not), and
with `seniority` (also the gateway's default) a resend queued by when its request was first sent
(`core.seniority.Seniority`, keyed by the request's id where the gateway digests its bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.gateway.core.adapters import AdapterState
from kvserve.gateway.core.admission_core import AdmissionCore, AdmissionLimits, Ticket
from kvserve.gateway.core.lifecycle import Dispatch, Ledger
from kvserve.gateway.core.pipeline import RouteRequest, RoutingPolicy, WorkerView
from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from kvserve.gateway.core.seniority import DEFAULT_TTL_S


@dataclass(frozen=True, slots=True)
class Backpressure:
    """Admission limits (the gateway's defaults) and the Retry-After it answers 429s with."""

    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 1.0
    retry_after_s: int = 1
    latency_limit: bool = True
    seniority: bool = True
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    seniority_ttl_s: float = DEFAULT_TTL_S  # the gateway's constant; a sweep varies it
    declared_batch: bool = True  # the workers say their batch, as kvserve's do

    def __post_init__(self) -> None:
        self.limits()  # checks the bounds

    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_in_flight, self.max_queued, self.queue_timeout_s,
                               self.max_queue_wait_s, self.retry_after_s)


@dataclass(frozen=True, slots=True)
class Scraped:
    """One worker's metrics as of a scrape."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    adapters: AdapterState | None = None  # its vllm:lora_requests_info


class TicketHold:
    """An admission ticket as a dispatch's `Hold`: the simulator's admission core answers each
    call with the queued tickets it now admits, which collect here until the simulator starts
    them at the time it chooses (`take_admitted`)."""

    __slots__ = ("admission", "admitted", "ticket")

    def __init__(self, admission: AdmissionCore, ticket: Ticket) -> None:
        self.admission = admission
        self.ticket = ticket
        self.admitted: list[Ticket] = []

    def first_byte(self, late: bool, answer_s: float | None = None) -> None:
        self.admitted += self.admission.first_byte(self.ticket, late, answer_s)

    def gave_up(self, waited_s: float | None = None) -> None:
        self.admission.gave_up(self.ticket, waited_s)

    def release(self) -> None:
        self.admitted += self.admission.release(self.ticket)

    def take_admitted(self) -> list[Ticket]:
        taken, self.admitted = self.admitted, []
        return taken


class SimGateway(Ledger):
    """Routes with `policy` over `worker_ids` through the gateway's own dispatch lifecycle
    (`core.lifecycle.Dispatch`); as its ledger, counts what it sent and what it refused."""

    def __init__(self, policy: RoutingPolicy, worker_ids: Iterable[str]) -> None:
        self.policy = policy
        self.worker_ids = tuple(worker_ids)
        self.in_flight = dict.fromkeys(self.worker_ids, 0)
        self.backlog_tokens = dict.fromkeys(self.worker_ids, 0)
        self.scraped = {w: Scraped() for w in self.worker_ids}
        self.num_in_flight = 0
        self.num_routed = 0
        self.num_throttled = 0  # 429s answered
        self.routed_by_worker = dict.fromkeys(self.worker_ids, 0)

    def update(self, worker_id: str, scraped: Scraped) -> None:
        """Record a scrape of one worker."""
        self.scraped[worker_id] = scraped

    def views(self) -> list[WorkerView]:
        """What a policy sees now: exact in-flight counts, scraped queue depth, KV usage and
        adapters."""
        return [
            WorkerView(w, True, self.in_flight[w], s.num_running, s.num_waiting, s.kv_usage,
                       self.backlog_tokens[w], s.adapters)
            for w in self.worker_ids
            for s in (self.scraped[w],)
        ]

    def dispatch(self, request: RouteRequest, sent_at: float, now: float,
                 deadline: float | None = None, hold: TicketHold | None = None) -> Dispatch:
        """Pick a worker for a request its client sent at `sent_at`, admitted and sent `now`
        (the simulator sends at once; a worker's refusal is its answer)."""
        dispatch = Dispatch(self.policy, self, request, started=sent_at, admitted=now,
                            deadline=deadline, hold=hold)
        decision = dispatch.pick(self.views())
        dispatch.send(decision.worker_id, now)
        return dispatch

    # -- Ledger ---------------------------------------------------------------------------

    def count_sent(self, worker_id: str) -> None:
        self.in_flight[worker_id] += 1
        self.num_in_flight += 1
        self.num_routed += 1
        self.routed_by_worker[worker_id] += 1

    def count_ended(self, worker_id: str, finished: bool) -> None:
        assert self.in_flight[worker_id] > 0, f"release without a request in flight on {worker_id}"
        self.in_flight[worker_id] -= 1
        self.num_in_flight -= 1

    def add_backlog(self, worker_id: str, tokens: int) -> None:
        self.backlog_tokens[worker_id] += tokens
        assert self.backlog_tokens[worker_id] >= 0, "backlog handed back twice"
