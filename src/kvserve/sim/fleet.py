"""The fleet simulator: clients → gateway policy → N workers, on one simulated clock.

Every request is a client (`client`), routed by the real policy object through `SimGateway`,
and served by a `SimWorker` holding a real KVCacheManager. Nothing here reads a wall clock
except to report how long the run took; the same inputs give the same result.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.gateway.core.admission_core import AdmissionCore, Ticket, TicketState
from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.core.pipeline import CapacityAware, RoutingPolicy, make_policy
from kvserve.gateway.core.seniority import Seniority
from kvserve.sim.adapters import AdapterSpec, TenantAdapters
from kvserve.sim.client import Attempt, ClientConfig, ClientRequest, Outcome
from kvserve.sim.costmodel import CostProfile
from kvserve.sim.events import EventQueue, Priority
from kvserve.sim.gateway import Backpressure, Scraped, SimGateway, TicketHold
from kvserve.sim.metrics import SimResult, TimelineSample
from kvserve.sim.seq import SimSeq
from kvserve.sim.summary import summarise
from kvserve.sim.worker import SimWorker, WorkerConfig
from kvserve.sim.workload import RouteKeys, Workload
from kvserve.workload import prompt_token_ids

SIMULATED_POLICIES = ("round_robin", "least_load", "prefix_hash", "cache_aware",
                      "lora_affinity")
"""Policies the simulator can drive (`precise` needs KV-event plumbing it does not model)."""

Progress = Callable[[int, int, float], None]
"""Called as requests complete: (done, total, simulated seconds)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One run: the fleet, its gateway and its clients. `route_block_tokens` is the gateway's
    prefix block (its 256-character text blocks are ~64 tokens). `worker_ids` names the workers
    (default w00, w01, ...): rendezvous hashing ranks workers by id, so a simulation that must
    place keys where a real gateway did uses the real gateway's ids (its worker URLs)."""

    num_workers: int
    worker: WorkerConfig
    profile: CostProfile
    policy: str = "prefix_hash"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    client: ClientConfig = field(default_factory=ClientConfig)
    backpressure: Backpressure | None = None
    scrape_interval_s: float = 1.0
    route_block_tokens: int = 64
    slo_s: float = 5.0
    seed: int = 0
    worker_ids: tuple[str, ...] | None = None
    adapters: AdapterSpec | None = None  # tenants' LoRA adapters (`adapters.py`); None: none

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("a fleet needs at least one worker")
        if self.worker_ids is not None and (len(self.worker_ids) != self.num_workers
                                            or len(set(self.worker_ids)) != self.num_workers):
            raise ValueError(f"worker_ids must be {self.num_workers} distinct names, got "
                             f"{list(self.worker_ids)}")
        if self.policy not in SIMULATED_POLICIES:
            raise ValueError(f"policy {self.policy!r} cannot be simulated; choose one of "
                             f"{', '.join(SIMULATED_POLICIES)}")
        if self.scrape_interval_s <= 0:
            raise ValueError("scrape_interval_s must be positive")

    def worker_config(self) -> WorkerConfig:
        """The workers' config, with the adapter workload's slots and load time."""
        spec = self.adapters
        if spec is None:
            return self.worker
        return replace(self.worker, enable_lora=True, max_loras=spec.max_loras,
                       adapter_load_s=spec.load_s)

    def make_policy(self) -> RoutingPolicy:
        options = dict(self.policy_options)
        if self.policy == "least_load":
            options.setdefault("seed", self.seed)
        return make_policy(self.policy, **options)


class FleetSimulator:
    """Runs one `SimConfig` over one `Workload`; call `run` once."""

    def __init__(self, config: SimConfig, workload: Workload,
                 route_keys: RouteKeys | None = None, label: str | None = None) -> None:
        self.config = config
        self.workload = workload
        self.label = label or config.policy
        self.events = EventQueue()
        self.keys = route_keys or RouteKeys(config.route_block_tokens)
        ids = list(config.worker_ids or (f"w{i:02d}" for i in range(config.num_workers)))
        worker = config.worker_config()
        self.workers = {w: SimWorker(w, worker, config.profile, self.events, self)
                        for w in ids}
        self.tenant_adapters = (TenantAdapters(config.adapters)
                                if config.adapters is not None else None)
        policy = config.make_policy()
        if isinstance(policy, CapacityAware):  # as the gateway learns it from /metrics
            for worker_id in ids:
                policy.set_worker_capacity(worker_id,
                                           config.worker.num_blocks * config.worker.block_size)
        self.gateway = SimGateway(policy, ids)
        bp = config.backpressure
        latency = (LatencyLimit(bp.max_in_flight, floor=min(len(ids), bp.max_in_flight))
                   if bp is not None and bp.latency_limit else None)
        # The gateway's own admission, on the simulated clock (None: admit everything).
        self.admission = (AdmissionCore(bp.limits(), latency=latency,
                                        latency_applies=lambda: not bp.declared_batch,
                                        clock=lambda: self.events.now)
                          if bp is not None else None)
        self.seniority = (Seniority(bp.seniority_ttl_s)
                          if bp is not None and bp.seniority else None)
        self.clients: list[ClientRequest] = []
        self.timeline: list[TimelineSample] = []
        self._attempt_of: dict[str, Attempt] = {}
        self._queued: dict[Ticket, Attempt] = {}  # waiting for an admission slot
        self._arrivals: Iterator[ClientRequest] = iter(())
        self._num_done = 0
        self._progress: Progress | None = None

    # -- running --------------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> SimResult:
        """Simulate until every request is answered or given up; summarise.

        The cyclic garbage collector is paused meanwhile: the caches hold millions of
        long-lived objects that its full scans would walk again and again, and the simulator
        creates no reference cycles per event (reference counting frees everything)."""
        started = time.perf_counter()
        self._progress = progress
        self.clients = [ClientRequest(r, r.arrival_ms / 1000.0) for r in self.workload.requests]
        self._arrivals = iter(self.clients)
        self._next_arrival()
        self.events.push(0.0, Priority.SCRAPE, self._scrape)
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            while self.events.run_next():
                pass
        finally:
            if was_enabled:
                gc.enable()
        return summarise(self, time.perf_counter() - started)

    def _next_arrival(self) -> None:
        client = next(self._arrivals, None)
        if client is not None:
            self.events.push(client.arrival, Priority.CLIENT, lambda now: self._arrive(client))

    def _arrive(self, client: ClientRequest) -> None:
        now = self.events.now
        client.prompt = prompt_token_ids(client.trace)
        tenants = self.tenant_adapters
        client.adapter = (tenants.adapter_for(client.trace.tenant) if tenants is not None
                          else None)
        client.route = self.keys.route_request(client.trace, client.prompt, client.adapter)
        self._send(client, now)
        self._next_arrival()

    def _scrape(self, now: float) -> None:
        """The gateway's periodic scrape, also the timeline's sample; stops when all is done."""
        gateway = self.gateway
        hits = queries = 0
        for worker_id, worker in self.workers.items():
            gateway.update(worker_id, Scraped(worker.num_running, worker.num_waiting,
                                              worker.kv_usage, worker.adapters))
            counters = worker.kv.counters
            hits += counters.prefix_hits_tokens
            queries += counters.prefix_queries_tokens
        self.timeline.append(TimelineSample(
            now, tuple(s.num_running + s.num_waiting for s in gateway.scraped.values()),
            tuple(gateway.in_flight.values()), queries, hits))
        if self._num_done < len(self.clients):
            self.events.push(now + self.config.scrape_interval_s, Priority.SCRAPE, self._scrape)

    # -- clients and admission ------------------------------------------------------------

    def _send(self, client: ClientRequest, now: float) -> None:
        attempt = Attempt(client, client.num_attempts, now)
        client.num_attempts += 1
        timeout = self.config.client.ttft_timeout_s
        if timeout is not None:
            self.events.push(now + timeout, Priority.CLIENT,
                             lambda t: self._on_timeout(attempt, t))
        admission = self.admission
        if admission is None:
            self._dispatch(attempt, now)
            return
        since = (now if self.seniority is None
                 else self.seniority.since(client.trace.request_id.encode(), now))
        ticket = admission.arrive(None if timeout is None else now + timeout, since)
        attempt.ticket = ticket
        if ticket.state is TicketState.ADMITTED:
            self._dispatch(attempt, now)
        elif ticket.state is TicketState.QUEUED:
            self._queued[ticket] = attempt
            self.events.push(ticket.expires_at, Priority.CLIENT,
                             lambda t: self._on_queue_timeout(attempt, t))
        else:
            self._throttle(attempt, now)

    def _throttle(self, attempt: Attempt, now: float) -> None:
        """429 + Retry-After: the client waits, then sends again."""
        bp = self.config.backpressure
        assert bp is not None
        attempt.is_over = True
        client = attempt.request
        client.num_throttled += 1
        self.gateway.num_throttled += 1
        self.events.push(now + bp.retry_after_s, Priority.CLIENT,
                         lambda t: self._send(client, t))

    def _on_queue_timeout(self, attempt: Attempt, now: float) -> None:
        assert self.admission is not None and attempt.ticket is not None
        if not attempt.is_over and self.admission.expire(attempt.ticket):
            del self._queued[attempt.ticket]
            self._throttle(attempt, now)

    def _start(self, admitted: list[Ticket], now: float) -> None:
        """Dispatch the queued attempts admission just let in."""
        for ticket in admitted:
            self._dispatch(self._queued.pop(ticket), now)

    def _dispatch(self, attempt: Attempt, now: float) -> None:
        client = attempt.request
        assert client.route is not None and client.prompt is not None
        timeout = self.config.client.ttft_timeout_s
        hold = (TicketHold(self.admission, attempt.ticket)
                if self.admission is not None and attempt.ticket is not None else None)
        dispatch = attempt.dispatch = self.gateway.dispatch(
            client.route, attempt.sent_at, now,
            None if timeout is None else attempt.sent_at + timeout, hold)
        worker_id = dispatch.worker_id
        assert worker_id is not None
        trace = client.trace
        seq = SimSeq(f"{trace.request_id}#{attempt.number}", client.prompt,
                     max(1, trace.output_length), trace.tenant, client.adapter)
        attempt.seq, attempt.worker_id = seq, worker_id
        attempt.dispatched_at = now
        self._attempt_of[seq.seq_id] = attempt
        if not self.workers[worker_id].submit(seq, now):
            del self._attempt_of[seq.seq_id]
            attempt.is_over = True
            self._release(attempt, now, client_left=False)
            self._complete(client, Outcome.REJECTED, now)

    def _on_timeout(self, attempt: Attempt, now: float) -> None:
        client = attempt.request
        if attempt.is_over or client.first_token_at is not None:
            return
        attempt.is_over = True
        if attempt.seq is None:  # still queued for admission
            assert self.admission is not None and attempt.ticket is not None
            del self._queued[attempt.ticket]
            self.admission.leave(attempt.ticket)
        elif attempt.worker_id is not None:
            del self._attempt_of[attempt.seq.seq_id]
            self.workers[attempt.worker_id].abort(attempt.seq, now)
            # gave up after admission: the fleet answers too slowly for it
            self._release(attempt, now, client_left=True)
        if client.num_retries < self.config.client.max_retries:
            client.num_retries += 1
            self._send(client, now)
        else:
            self._complete(client, Outcome.GAVE_UP, now)

    def _release(self, attempt: Attempt, now: float, client_left: bool) -> None:
        """The attempt's upstream request ended: the gateway's counts, and its admission slot
        (which may let queued attempts in)."""
        dispatch = attempt.dispatch
        assert dispatch is not None
        dispatch.close(now, finished=not client_left, client_left=client_left)
        if isinstance(dispatch.hold, TicketHold):
            self._start(dispatch.hold.take_admitted(), now)

    def _overhead_s(self, client: ClientRequest) -> float:
        return self.config.profile.request_overhead_s(client.trace.input_length)

    def _complete(self, client: ClientRequest, outcome: Outcome, now: float) -> None:
        client.outcome = outcome
        client.prompt = None
        self._num_done += 1
        if self._progress is not None:
            self._progress(self._num_done, len(self.clients), now)

    # -- WorkerListener -------------------------------------------------------------------

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        attempt = self._attempt_of.get(seq.seq_id)  # None: cancelled while its step ran
        if attempt is None or attempt.dispatch is None:
            return
        attempt.dispatch.answered_by(200)  # its prefill is no longer ahead of others
        if attempt.request.first_token_at is None:
            # What the client sees also includes the API path (the profile's request overhead).
            at = now + self._overhead_s(attempt.request)
            attempt.request.first_token_at = at
            if self.seniority is not None:
                self.seniority.served(attempt.request.trace.request_id.encode())
            attempt.dispatch.first_byte(at)  # judged as the gateway judges, for admission
            if isinstance(attempt.dispatch.hold, TicketHold):
                self._start(attempt.dispatch.hold.take_admitted(), at)

    def on_finish(self, seq: SimSeq, now: float) -> None:
        attempt = self._attempt_of.pop(seq.seq_id, None)
        if attempt is None:
            return  # cancelled by the client while its last step ran; already let go
        attempt.is_over = True
        self._release(attempt, now, client_left=False)
        client = attempt.request
        client.finished_at = now + self._overhead_s(client)
        client.num_cached_tokens = max(seq.num_cached, 0)
        self._complete(client, Outcome.OK, now)
