"""One soak-and-chaos run: start the fleet, warm up under load, then inject the faults in turn
(cycling through them until `duration_s` is spent), each: inject, doctor while it lasts, hold,
recover, wait until the fleet is whole again, settle, then a quiet check (load paused until no
request is in flight: every worker's held blocks back to 0, its audit clean) and the doctor
again. Every wait is bounded; whatever happens, the fleet is stopped at the end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos.doctor import run_doctor
from benchmarks.chaos.faults import FAULTS, Fault
from benchmarks.chaos.fleet import Fleet, debug_kv, gateway_url, start_fleet
from benchmarks.chaos.load import Load
from benchmarks.chaos.recorder import Recorder, kv_summary

RECOVER_BOUND_S = 120.0
QUIET_BOUND_S = 60.0


@dataclass
class Config:
    out: Path
    duration_s: float
    faults: list[str]
    workers: int = 2
    rps: float = 2.0
    warmup_s: float = 30.0
    settle_s: float = 15.0
    interval_s: float = 5.0
    model: str | None = None
    envoy: bool = True
    seed: int = 0
    hold_scale: float = 1.0  # each fault lasts its hold_s times this
    cycles: int = 0  # > 0: each fault exactly this many times, whatever duration_s says


@dataclass
class RunLog:
    config: Config
    began: float = 0.0
    ended: float = 0.0
    faults: list[dict[str, Any]] = field(default_factory=list)
    quiet_checks: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # fault -> why it could not run


def whole(fleet: Fleet, n: int) -> bool:
    """Every process up and every gateway seeing every worker healthy."""
    if not all(p.alive() for p in fleet.procs()):
        return False
    for gateway in fleet.gateways:
        try:
            health = httpx.get(f"{gateway_url(gateway)}/health", timeout=3.0).json()
        except (httpx.HTTPError, ValueError):
            return False
        if health.get("healthy_workers") != n:
            return False
    return all(w.proc.ready() for w in fleet.workers)


def wait_whole(fleet: Fleet, n: int, bound_s: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < bound_s:
        if whole(fleet, n):
            return time.monotonic() - began
        time.sleep(0.5)
    return None


def quiet_check(fleet: Fleet, load: Load, label: str) -> dict[str, Any]:
    """Load paused and drained: each worker's held blocks 0 and audit clean (bounded wait for
    the last frees)."""
    drained = load.quiesce(QUIET_BOUND_S)
    end = time.monotonic() + 20.0
    while True:
        rows = {f"worker{i}": kv_summary(debug_kv(w)) for i, w in enumerate(fleet.workers)}
        clean = all(r.get("answered") and r["held"] == 0 and r["audit_ok"]
                    for r in rows.values())
        if clean or time.monotonic() > end:
            break
        time.sleep(0.5)
    load.resume()
    return {"t": time.time(), "label": label, "drained": drained, "clean": clean,
            "workers": rows}


def run(config: Config) -> RunLog:
    config.out.mkdir(parents=True, exist_ok=True)
    log = RunLog(config, began=time.time())
    fleet = start_fleet(config.out, config.workers, config.model, config.envoy,
                        disk_tier="disk_full" in config.faults,
                        tp_worker=any(f.startswith("tp_") for f in config.faults))
    recorder = Recorder(fleet, config.out, config.interval_s)
    load: Load | None = None
    try:
        model = httpx.get(f"{fleet.workers[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        entries = {g.name: gateway_url(g) for g in fleet.gateways}
        if fleet.envoy_url is not None:
            entries["envoy"] = fleet.envoy_url
        recorder.start()
        load = Load(entries, model, config.rps, config.out, config.seed)
        load.start()
        time.sleep(config.warmup_s)
        log.quiet_checks.append(quiet_check(fleet, load, "after warm-up"))
        deadline = log.began + config.duration_s
        k = 0
        total = config.cycles * len(config.faults)
        while (k < total) if total else (time.time() < deadline - 60):
            fault = FAULTS[config.faults[k % len(config.faults)]]
            k += 1
            why_not = fault.available(fleet)
            if why_not is not None:
                log.skipped[fault.name] = why_not
                if len(log.skipped) == len(set(config.faults)):
                    break
                continue
            target = fault.target if fault.target is not None else k % config.workers
            if fault.name.startswith("tp_") and fleet.tp_index is not None:
                target = fleet.tp_index
            log.faults.append(inject_one(fleet, load, fault, target, config))
            _save(log)
        load.stop()
        log.quiet_checks.append(quiet_check(fleet, load, "at the end"))
    finally:
        if load is not None:
            load.stop(5.0)
        recorder.stop()
        log.ended = time.time()
        fleet.stop()
        _save(log)
    log.recorder = recorder  # type: ignore[attr-defined]
    log.load = load  # type: ignore[attr-defined]
    return log


def inject_one(fleet: Fleet, load: Load, fault: Fault, target: int,
               config: Config) -> dict[str, Any]:
    row: dict[str, Any] = {"fault": fault.name, "what": fault.what, "target": target,
                           "inject": time.time()}
    hold_s = fault.hold_s * config.hold_scale
    if fault.busy:
        load.focus(f"direct:worker{target}", fleet.workers[target].url)
    try:
        fault.inject(fleet, target)
        row["inject_error"] = None
    except Exception as exc:  # recorded as a finding; the run goes on
        row["inject_error"] = f"{type(exc).__name__}: {exc}"[-500:]
    time.sleep(max(hold_s / 2, hold_s - 12.0))  # the doctor reads the fault established
    gateways = [gateway_url(g) for g in fleet.gateways if g.alive()][:1]
    row["doctor_during"] = run_doctor(gateways or [fleet.workers[target].url])
    time.sleep(max(0.0, hold_s - (time.time() - row["inject"])))
    load.focus(None)
    row["recover"] = time.time()
    try:
        fault.recover(fleet, target)
        row["recover_error"] = None
    except Exception as exc:  # recorded as a finding; the run goes on
        row["recover_error"] = f"{type(exc).__name__}: {exc}"[-500:]
    took = wait_whole(fleet, config.workers, RECOVER_BOUND_S)
    row["recovered"] = None if took is None else time.time()
    time.sleep(config.settle_s)
    row["quiet"] = quiet_check(fleet, load, f"after {fault.name}")
    row["doctor_after"] = run_doctor([gateway_url(g) for g in fleet.gateways][:1])
    row["end"] = time.time()
    return row


def _save(log: RunLog) -> None:
    data = {"config": {k: str(v) if isinstance(v, Path) else v
                       for k, v in vars(log.config).items()},
            "began": log.began, "ended": log.ended, "faults": log.faults,
            "quiet_checks": log.quiet_checks, "skipped": log.skipped}
    (log.config.out / "run.json").write_text(json.dumps(data, indent=1, default=str))
