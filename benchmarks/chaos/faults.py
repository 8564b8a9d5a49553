"""The fault classes, each an inject and a recover step on the live fleet, with what must
follow: the alerts that must fire (`must`), those that may (`may`: consequences of the fault,
such as a scrape failing while a worker is down), and the doctor's problem that names it (None:
the fault is one the fleet absorbs, and the doctor must find nothing above info), with the
problems of any second detector of the very same fault (`also`)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.chaos.fleet import Fleet

DOWN_ALERTS = frozenset({"KVServeWorkerScrapeDown", "KVServeGatewayWorkerUnhealthy",
                         "KVServeEngineDown", "KVServeGatewayKVIndexUnknown"})
# A worker started again has an empty cache: its hit rate collapses, rightly, for a while.
RESTART_ALERTS = DOWN_ALERTS | {"KVServePrefixHitRateCollapse"}
HOOKS = {"KVSERVE_TEST_HOOKS": "1"}
# Late enough that the restarted worker was scraped at 0 first: a counter first seen at 1
# is no increase to Prometheus, and the alert would never fire.
CORRUPT = {**HOOKS, "KVSERVE_KV_FAULT": "reassign:150"}
# A reassigned block is also a stale hash to the worker's periodic audit when one runs while
# the block is in the cache: the same planted fault seen by the second check, not another one.
AUDIT_ALERTS = frozenset({"KVServeAuditFailure"})


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    inject: Callable[[Fleet, int], None]
    recover: Callable[[Fleet, int], None]
    hold_s: float
    must: frozenset[str] = frozenset()
    may: frozenset[str] = frozenset()
    doctor: str | None = None
    also: frozenset[str] = frozenset()  # another check's name for the same fault
    target: int | None = None  # the worker it always hits (else the run's turn)
    busy: bool = False  # it shows only on a worker with requests: send it some directly
    available: Callable[[Fleet], str | None] = lambda fleet: None  # why not, if it cannot run


def _restart(fleet: Fleet, i: int, env: dict[str, str] | None = None) -> None:
    worker = fleet.workers[i].proc
    worker.stop(30.0)
    worker.start(env)
    worker.wait_ready(300.0)


def _kill(fleet: Fleet, i: int) -> None:
    fleet.workers[i].proc.kill()


def _start_again(fleet: Fleet, i: int) -> None:
    fleet.workers[i].proc.start()
    fleet.workers[i].proc.wait_ready(300.0)


def _gateway_kill(fleet: Fleet, i: int) -> None:
    fleet.gateways[-1].kill()


def _gateway_start(fleet: Fleet, i: int) -> None:
    fleet.gateways[-1].start()
    fleet.gateways[-1].wait_ready(300.0)


def _epp_kill(fleet: Fleet, i: int) -> None:
    assert fleet.epp is not None
    fleet.epp.kill()


def _epp_start(fleet: Fleet, i: int) -> None:
    assert fleet.epp is not None
    fleet.epp.start()
    fleet.epp.wait_ready(300.0)


def _delay(seconds: float) -> Callable[[Fleet, int], None]:
    def set_delay(fleet: Fleet, i: int) -> None:
        fleet.workers[i].http_proxy.delay_s = seconds
    return set_delay


def _partition(on: bool) -> Callable[[Fleet, int], None]:
    def set_partition(fleet: Fleet, i: int) -> None:
        fleet.workers[i].http_proxy.partition(on)
        if on:
            fleet.workers[i].http_proxy.cut()
    return set_partition


def _events(on: bool) -> Callable[[Fleet, int], None]:
    def drop_events(fleet: Fleet, i: int) -> None:
        proxy = fleet.workers[i].event_proxy
        proxy.partition(on)  # what the publisher sends meanwhile never arrives
        if not on:
            proxy.cut()  # and the link drops: the publisher reconnects, the gap is replayed
    return drop_events


def _fill(fleet: Fleet, i: int) -> None:
    """Write a file into worker0's disk-tier filesystem until it is full."""
    assert fleet.disk_dir is not None
    with (fleet.disk_dir / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):
        for _ in range(1 << 16):  # bounded: 4 GiB at most
            f.write(b"\0" * 65536)


def _unfill(fleet: Fleet, i: int) -> None:
    assert fleet.disk_dir is not None
    (fleet.disk_dir / "filler").unlink(missing_ok=True)


def _tp_restart(env: dict[str, str] | None) -> Callable[[Fleet, int], None]:
    def restart(fleet: Fleet, i: int) -> None:
        assert fleet.tp_index is not None
        _restart(fleet, fleet.tp_index, env)
    return restart


def _tp_start_again(fleet: Fleet, i: int) -> None:
    """The lost rank took its worker down (or will): start it again, plainly."""
    assert fleet.tp_index is not None
    worker = fleet.workers[fleet.tp_index].proc
    worker.kill()
    worker.start()
    worker.wait_ready(300.0)


def _has_tp(fleet: Fleet) -> str | None:
    return None if fleet.tp_index is not None else "no tensor-parallel worker (--tp-worker)"


def _has_disk(fleet: Fleet) -> str | None:
    return None if fleet.disk_dir is not None else "no tmpfs could be mounted (needs root)"


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("latency", "250 ms added each way between the gateways and one worker",
          _delay(0.25), _delay(0.0), 30.0),
    Fault("events_dropped", "one worker's KV events blackholed, then its link reset",
          _events(True), _events(False), 20.0),
    Fault("worker_stop", "one worker SIGSTOPped (hung), then SIGCONT",
          lambda f, i: f.workers[i].proc.signal(signal.SIGSTOP),
          lambda f, i: f.workers[i].proc.signal(signal.SIGCONT), 30.0,
          must=frozenset({"KVServeWorkerScrapeDown"}), may=DOWN_ALERTS, doctor="down"),
    Fault("worker_kill", "one worker SIGKILLed, then started again (its KV-event publisher "
          "restarts at seq 0)", _kill, _start_again, 20.0,
          must=frozenset({"KVServeWorkerScrapeDown"}), may=RESTART_ALERTS, doctor="down"),
    Fault("partition", "the link between the gateways and one worker blackholed",
          _partition(True), _partition(False), 30.0,
          must=frozenset({"KVServeGatewayWorkerUnhealthy"}), may=DOWN_ALERTS, doctor="down"),
    Fault("gateway_kill", "a gateway replica SIGKILLed, then started again",
          _gateway_kill, _gateway_start, 20.0, may=frozenset({"KVServeWorkerScrapeDown"})),
    Fault("picker_restart", "the picker behind Envoy SIGKILLed, then started again",
          _epp_kill, _epp_start, 15.0, may=frozenset({"KVServeWorkerScrapeDown"})),
    Fault("corruption", "a block in use reassigned under a live request (the worker restarted "
          "gracefully with KVSERVE_KV_FAULT=reassign:150; recovered by a plain restart)",
          lambda f, i: _restart(f, i, CORRUPT), lambda f, i: _restart(f, i), 30.0,
          must=frozenset({"KVServeCacheCorruption"}), may=RESTART_ALERTS | AUDIT_ALERTS,
          doctor="corruption", also=frozenset({"audit"}), busy=True),
    Fault("disk_full", "worker0's disk-tier filesystem (a tmpfs) filled up, then emptied",
          _fill, _unfill, 30.0, target=0, available=_has_disk, busy=True),
    Fault("tp_stall", "rank 1 of the tensor-parallel worker stalls 0.1 s before each step "
          "(from step 20 until recovered): every all_reduce waits on it (restarted with "
          "KVSERVE_TP_FAULT)",
          _tp_restart({**HOOKS, "KVSERVE_TP_FAULT": "1:20-100000:delay:0.1"}),
          _tp_restart(None), 90.0, must=frozenset({"KVServeAllReduceSlow"}),
          may=RESTART_ALERTS, doctor="collective", available=_has_tp, busy=True),
    # The worker exits as soon as its group fails (its supervisor restarts it): by the time
    # the doctor reads it, it can only say the worker is down; the collective error is in
    # the worker's last words and, if a scrape fell in between, KVServeCollectiveErrors.
    Fault("tp_lost_rank", "rank 1 of the tensor-parallel worker exits at step 20 (restarted "
          "with KVSERVE_TP_FAULT), then the worker is started again",
          _tp_restart({**HOOKS, "KVSERVE_TP_FAULT": "1:20:exit"}), _tp_start_again, 30.0,
          must=frozenset({"KVServeWorkerScrapeDown"}),
          may=RESTART_ALERTS | {"KVServeCollectiveErrors"}, doctor="down", available=_has_tp,
          busy=True),
]}
