"""`python -m benchmarks knobs`: sweep one of the gateway's constants through the fleet simulator.

The gateway's admission and latency-limit constants are not options (docs/operations.md,
"Constants that are not options"), so `kvserve simulate` has no flag for them. This harness runs
the simulator in this process, once per value and seed, with the constant set for that run only
and restored after it, and prints one row per run. Everything after `--` is `kvserve
simulate`'s own flags (workload, fleet, clients); `--seed` there is replaced by `--seeds`.

    python -m benchmarks knobs --knob late_fraction --values 0.5,0.75,0.9 --seeds 0,1 -- \\
        --trace multi-tenant --requests 300 --rate 8 --policy cache_aware \\
        --retries --backpressure --undeclared-batch

Knobs: `late_fraction`, `decrease` (the latency limit's), `rate_window_s`, `min_rate_samples`
(admission's service rate), `answer_quantile`, `answer_samples`, `min_answer_samples`
(queue_wait's recent answer time), `seniority_ttl_s`, `slot_headroom` (a worker's slots past
its batch, as a fraction of it; `default` is `worker_pool.worker_slots`), `cold_load_factor`
(the bound `cache_aware` and `precise` place a prefix no index holds under). With `--adapters`
after `--`, a column of adapter loads per request.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from functools import partial
from unittest import mock

from rich.console import Console
from rich.table import Table

from kvserve.gateway.core import admission_core, latency_limit, queue_wait
from kvserve.gateway.core.pipeline import cache_aware, precise, prefix_hash
from kvserve.gateway.fleet.worker_pool import worker_slots
from kvserve.sim import command, fleet
from kvserve.sim.fleet import FleetSimulator

_CONSTANTS = {  # knob: (modules that hold it, name, type)
    "late_fraction": ((latency_limit,), "LATE_FRACTION", float),
    "rate_window_s": ((admission_core,), "RATE_WINDOW_S", float),
    "min_rate_samples": ((admission_core,), "MIN_RATE_SAMPLES", int),
    "answer_quantile": ((queue_wait,), "ANSWER_QUANTILE", float),
    "answer_samples": ((queue_wait,), "ANSWER_SAMPLES", int),
    "min_answer_samples": ((queue_wait,), "MIN_ANSWER_SAMPLES", int),
    # the policies import it by name, so each module's binding is set
    "cold_load_factor": ((prefix_hash, cache_aware, precise), "COLD_LOAD_FACTOR", float),
}
KNOBS = (*_CONSTANTS, "decrease", "seniority_ttl_s", "slot_headroom")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("knobs", help="sweep a gateway constant through the fleet simulator",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knob", required=True, choices=KNOBS)
    p.add_argument("--values", required=True, help="comma-separated values, e.g. 0.5,0.75,0.9")
    p.add_argument("--seeds", default="0,1", help="comma-separated workload seeds")
    p.add_argument("--json", action="store_true", help="also print each run's summary as JSON")
    p.add_argument("simulate", nargs=argparse.REMAINDER,
                   help="-- then `kvserve simulate` flags (one policy)")
    p.set_defaults(func=run)


def _simulate_args(argv: list[str], seed: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="knobs --")
    command.add_parser(parser.add_subparsers())
    argv = [a for a in argv if a != "--"]
    return parser.parse_args(["simulate", *argv, "--seed", str(seed)])


@contextlib.contextmanager
def _setting(knob: str, value: str, sim_args: argparse.Namespace) -> Iterator[
        Callable[[FleetSimulator], None]]:
    """Set `knob` to `value` for one run: yields a hook for the built simulator."""
    if knob in _CONSTANTS:
        modules, name, kind = _CONSTANTS[knob]
        olds = [getattr(m, name) for m in modules]
        for m in modules:
            setattr(m, name, kind(value))
        try:
            yield lambda sim: None
        finally:
            for m, old in zip(modules, olds, strict=True):
                setattr(m, name, old)
    elif knob == "decrease":  # fleet builds its limit by the name it imported: patch that binding
        limited = partial(latency_limit.LatencyLimit, decrease=float(value))
        with mock.patch.object(fleet, "LatencyLimit", limited):
            yield lambda sim: None
    elif knob == "slot_headroom":
        batch = sim_args.max_num_seqs or 256
        slots = (worker_slots(batch) if value == "default"
                 else batch + int(float(value) * batch))

        def wire(sim: FleetSimulator) -> None:  # the gateway learns the batch from /metrics
            assert sim.admission is not None, "slot_headroom needs --backpressure"
            sim.admission.fleet_slots = lambda: slots * len(sim.workers)

        yield wire
    else:
        yield lambda sim: None


def run(args: argparse.Namespace) -> int:
    out = Console(width=160)
    table = Table(title=f"{args.knob} sweep")
    adapters = _simulate_args(args.simulate, 0).adapters > 0
    for col in ("value", "seed", "hit rate", "TTFT p50/p99", "TTFT≤SLO", "answered",
                "retries/429", *(["adapter loads/req"] if adapters else [])):
        table.add_column(col)
    ok = True
    for value in args.values.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            sim_args = _simulate_args(args.simulate, seed)
            if args.knob == "seniority_ttl_s":
                sim_args.backpressure = True
            tasks = command.build_tasks(sim_args)
            if len(tasks) != 1:
                raise SystemExit("give one policy and one client variant after --")
            config = tasks[0].config
            if args.knob == "seniority_ttl_s":
                assert config.backpressure is not None
                config = dataclasses.replace(config, backpressure=dataclasses.replace(
                    config.backpressure, seniority_ttl_s=float(value)))
            workload = command._workload(sim_args)
            with _setting(args.knob, value, sim_args) as wire:
                sim = FleetSimulator(config, workload, label=f"{args.knob}={value}")
                wire(sim)
                result = sim.run()
            ok &= result.audit_ok
            r = result.summary()
            table.add_row(value, str(seed), f"{r['hit_rate']:.1%}",
                          f"{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f} s",
                          f"{r['slo_attainment']:.1%}", f"{r['num_ok']}/{r['num_requests']}",
                          f"{r['num_retries']}/{r['num_throttled']}",
                          *([f"{result.adapter_loads_per_request:.3f}"] if adapters else []))
            if args.json:
                print(json.dumps({"knob": args.knob, "value": value, "seed": seed, **r,
                                  "adapter_loads_per_request": result.adapter_loads_per_request}))
    out.print(table)
    return 0 if ok else 1
