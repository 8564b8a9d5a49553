"""Run several simulations of one workload, serially or in forked processes, with progress.

Runs are independent (each has its own fleet, gateway and clients), so they parallelise
perfectly; each process computes its own route keys. Results come back in task order.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.sim.fleet import FleetSimulator, SimConfig
from kvserve.sim.metrics import SimResult
from kvserve.sim.workload import RouteKeys, Workload

TaskProgress = Callable[[int, int, int], None]
"""(task index, requests done, requests in all)."""

_REPORT_EVERY = 64  # requests between progress reports from a child process


@dataclass(frozen=True, slots=True)
class SimTask:
    """One run: a label for tables and plots, and its configuration."""

    label: str
    config: SimConfig


def run_tasks(tasks: Sequence[SimTask], workload: Workload, jobs: int = 1,
              progress: TaskProgress | None = None) -> list[SimResult]:
    """Every task's result, in task order. `jobs` > 1 runs that many at once in forked
    processes (where the platform can fork); otherwise one after another, sharing route keys."""
    if jobs > 1 and len(tasks) > 1 and "fork" in mp.get_all_start_methods():
        return _run_forked(tasks, workload, jobs, progress)
    keys: dict[int, RouteKeys] = {}
    results = []
    for idx, task in enumerate(tasks):
        block = task.config.route_block_tokens
        route_keys = keys.setdefault(block, RouteKeys(block))

        def report(done: int, total: int, _now: float, idx: int = idx) -> None:
            if progress is not None:
                progress(idx, done, total)

        sim = FleetSimulator(task.config, workload, route_keys, label=task.label)
        results.append(sim.run(report))
    return results


def _child(idx: int, task: SimTask, workload: Workload, done: Any, out: Any) -> None:
    def report(num_done: int, total: int, _now: float) -> None:
        if num_done % _REPORT_EVERY == 0 or num_done == total:
            done[idx] = num_done

    try:
        result = FleetSimulator(task.config, workload, label=task.label).run(report)
        out.put((idx, result, None))
    except BaseException as exc:  # reported to the parent, which raises it
        out.put((idx, None, f"{type(exc).__name__}: {exc}"))


def _start_without_inherited_garbage(proc: Any) -> None:
    """Fork `proc` so that it never collects the parent's objects. A forked child has only the
    forking thread, and an object whose finalizer waits on another thread (a torch.distributed
    process group left for the collector, as a tensor-parallel test leaves one) hangs the
    child's first full collection: seen as a test that never ended. So the parent collects its
    garbage first, where those threads run, and freezes the rest for the child."""
    gc.collect()
    gc.freeze()
    try:
        proc.start()
    finally:
        gc.unfreeze()


def _run_forked(tasks: Sequence[SimTask], workload: Workload, jobs: int,
                progress: TaskProgress | None) -> list[SimResult]:
    ctx = mp.get_context("fork")
    done = ctx.Array("q", len(tasks))
    out: Any = ctx.Queue()
    results: dict[int, SimResult] = {}
    running: dict[int, Any] = {}
    pending = list(range(len(tasks)))
    total = len(workload.requests)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                idx = pending.pop(0)
                proc = ctx.Process(target=_child, args=(idx, tasks[idx], workload, done, out))
                _start_without_inherited_garbage(proc)
                running[idx] = proc
            try:
                idx, result, error = out.get(timeout=0.2)
            except queue.Empty:
                idx = -1
            else:
                if error is not None:
                    raise RuntimeError(f"simulation {tasks[idx].label!r} failed: {error}")
                assert result is not None
                results[idx] = result
                running.pop(idx).join()
            for i, proc in list(running.items()):
                if not proc.is_alive() and i not in results and proc.exitcode not in (0, None):
                    raise RuntimeError(f"simulation {tasks[i].label!r} died ({proc.exitcode})")
            if progress is not None:
                for i in range(len(tasks)):
                    progress(i, total if i in results else done[i], total)
    finally:
        for proc in running.values():
            proc.kill()
            proc.join()
    return [results[i] for i in range(len(tasks))]
