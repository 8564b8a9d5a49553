"""The simulator and the proxy drive one admission core: the arrivals, ends and first bytes of a
simulated overload, replayed into the proxy's asyncio admission (on a virtual clock, its
queue timeouts its own), give the very same verdicts: who was admitted when, who was refused
when and why."""

from __future__ import annotations

import asyncio
import selectors
from dataclasses import dataclass, field

from kvserve.gateway.core.admission_core import AdmissionCore, Ticket, TicketState
from kvserve.gateway.core.latency_limit import LatencyLimit
from kvserve.gateway.fleet.admission import Admission, Saturated, Slot
from kvserve.sim import (
    BUILTIN,
    Backpressure,
    ClientConfig,
    FleetSimulator,
    SimConfig,
    WorkerConfig,
    load_workload,
)
from kvserve.workload import MultiTenantSpec


@dataclass
class Log:
    """What the simulator asked of its admission, in order, and the verdicts it got."""

    inputs: list[tuple] = field(default_factory=list)
    verdicts: list[tuple] = field(default_factory=list)
    ids: dict[Ticket, int] = field(default_factory=dict)


class RecordingCore(AdmissionCore):
    """The real core, logging each call with its time and each ticket's verdict."""

    log: Log

    def _name(self, ticket: Ticket) -> int:
        return self.log.ids.setdefault(ticket, len(self.log.ids))

    def _admitted(self, tickets: list[Ticket]) -> list[Ticket]:
        for ticket in tickets:
            self.log.verdicts.append((self._name(ticket), "admitted", round(self.clock(), 6)))
        return tickets

    def arrive(self, deadline=None, since=None, refuse_on_arrival=True):  # type: ignore[no-untyped-def]
        ticket = super().arrive(deadline, since, refuse_on_arrival)
        name = self._name(ticket)
        self.log.inputs.append(("arrive", self.clock(), name, deadline, since))
        if ticket.state is TicketState.ADMITTED:
            self._admitted([ticket])
        elif ticket.state is TicketState.REFUSED:
            self.log.verdicts.append((name, ticket.refusal, round(self.clock(), 6)))
        return ticket

    def expire(self, ticket: Ticket) -> bool:
        refused = super().expire(ticket)
        if refused:
            self.log.verdicts.append((self._name(ticket), ticket.refusal,
                                      round(self.clock(), 6)))
        return refused

    def leave(self, ticket: Ticket) -> list[Ticket]:
        self.log.inputs.append(("leave", self.clock(), self._name(ticket)))
        return self._admitted(super().leave(ticket))

    def release(self, ticket: Ticket) -> list[Ticket]:
        self.log.inputs.append(("release", self.clock(), self._name(ticket)))
        return self._admitted(super().release(ticket))

    def first_byte(self, ticket: Ticket, late: bool, answer_s: float | None) -> list[Ticket]:
        self.log.inputs.append(("first_byte", self.clock(), self._name(ticket), late, answer_s))
        return self._admitted(super().first_byte(ticket, late, answer_s))

    def gave_up(self, ticket: Ticket, waited_s: float | None) -> None:
        self.log.inputs.append(("gave_up", self.clock(), self._name(ticket), waited_s))
        super().gave_up(ticket, waited_s)


def simulate(bp: Backpressure) -> Log:
    """Two workers and far more long prompts than they can prefill, from clients that time out
    at 5 s and resend: admission queues, refuses and cuts its limit; every call recorded."""
    spec = MultiTenantSpec(num_tenants=8, num_requests=100, rate_per_s=2.0, skew=0.0, seed=3)
    config = SimConfig(num_workers=2, worker=WorkerConfig(num_blocks=80_000 // 64, block_size=64),
                       profile=BUILTIN["h100"], policy="cache_aware",
                       client=ClientConfig.retrying(5.0, 3), backpressure=bp)
    sim = FleetSimulator(config, load_workload("multi-tenant", spec=spec))
    assert sim.admission is not None
    recording = RecordingCore(sim.admission.limits, latency=sim.admission.latency,
                              latency_applies=sim.admission.latency_applies,
                              clock=sim.admission.clock)
    recording.log = Log()
    sim.admission = recording
    assert sim.run().audit_ok
    return recording.log


class VirtualClock:
    """An event loop whose time jumps to the next timer instead of sleeping."""

    def __init__(self) -> None:
        self.now = 0.0
        self.loop = asyncio.SelectorEventLoop(selectors.DefaultSelector())
        self.loop.time = lambda: self.now  # type: ignore[method-assign]
        selector = self.loop._selector  # type: ignore[attr-defined]
        real_select = selector.select

        def select(timeout: float | None = None) -> list:  # type: ignore[type-arg]
            if timeout is not None and timeout > 0:
                self.now += timeout
            return real_select(0)

        selector.select = select


def replay(log: Log, bp: Backpressure, workers: int) -> list[tuple]:
    """The simulator's inputs, at their times, into the proxy's `Admission`."""
    clock = VirtualClock()
    latency = (LatencyLimit(bp.max_in_flight, floor=min(workers, bp.max_in_flight))
               if bp.latency_limit else None)
    admission = Admission(bp.max_in_flight, bp.max_queued, bp.queue_timeout_s,
                          bp.retry_after_s, bp.max_queue_wait_s, latency=latency,
                          clock=clock.loop.time)
    verdicts: list[tuple] = []
    slots: dict[int, Slot] = {}
    waiting: dict[int, asyncio.Task[None]] = {}

    async def request(name: int, deadline: float | None, since: float | None) -> None:
        try:
            slots[name] = await admission.admit(deadline, since)
        except Saturated as exc:
            verdicts.append((name, exc.reason, round(clock.now, 6)))
            return
        verdicts.append((name, "admitted", round(clock.now, 6)))

    async def drive() -> None:
        for event in log.inputs:
            kind, at, name = event[:3]
            if at > clock.now:
                await asyncio.sleep(at - clock.now)
            for _ in range(3):
                await asyncio.sleep(0)  # let woken requests record their admission
            if kind == "arrive":
                waiting[name] = asyncio.ensure_future(request(name, event[3], event[4]))
                await asyncio.sleep(0)
            elif kind == "leave":
                if name in slots:
                    slots[name].release()
                else:
                    waiting[name].cancel()
            elif kind == "release":
                slots[name].release()
            elif kind == "first_byte":
                slots[name].first_byte(event[3], event[4])
            elif kind == "gave_up":
                slots[name].gave_up(event[3])
        await asyncio.gather(*waiting.values(), return_exceptions=True)

    clock.loop.run_until_complete(drive())
    clock.loop.close()
    return verdicts


def test_the_simulator_and_the_proxy_give_identical_verdicts() -> None:
    bp = Backpressure(max_in_flight=8, max_queued=6, declared_batch=False)  # latency limit on
    log = simulate(bp)
    kinds = {v[1] for v in log.verdicts}
    assert {"admitted", "queue full", "queue timeout"} <= kinds, kinds  # a real overload
    assert {"release", "first_byte", "gave_up"} <= {event[0] for event in log.inputs}
    replayed = replay(log, bp, workers=2)
    assert sorted(replayed) == sorted(log.verdicts)
