"""`python -m benchmarks chaos`: the soak-and-chaos harness (benchmarks/chaos/)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from benchmarks.chaos.faults import FAULTS

    p = sub.add_parser("chaos", help="soak and chaos: a fleet under load, faults on a schedule, "
                                     "verdicts and a report")
    p.add_argument("--out", type=Path, required=True, help="directory for logs and the report")
    p.add_argument("--duration-s", type=float, default=600.0, help="length of the run")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, injected in turn: {', '.join(FAULTS)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rps", type=float, default=2.0, help="open-loop arrival rate")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--settle-s", type=float, default=15.0)
    p.add_argument("--interval-s", type=float, default=5.0,
                   help="seconds between two recordings (one minute of alert-rule time)")
    p.add_argument("--model", default=None,
                   help="the workers' model (default: the random-weight demo model, fast; "
                        "give the real default model's GGUF to soak on real weights)")
    p.add_argument("--no-envoy", action="store_true", help="no Envoy + picker in front")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cycles", type=int, default=0,
                   help="inject each fault exactly this many times (then --duration-s is "
                        "ignored); 0: cycle through them until --duration-s is spent")
    p.add_argument("--hold-scale", type=float, default=1.0,
                   help="each fault lasts its own hold time times this (a short CI run: 0.5)")
    p.set_defaults(func=run_chaos)


def run_chaos(args: argparse.Namespace) -> int:
    from benchmarks.chaos.faults import FAULTS
    from benchmarks.chaos.run import Config, run

    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise SystemExit(f"--faults: unknown {unknown}; choose from {', '.join(FAULTS)}")
    if args.workers < 2:
        raise SystemExit("--workers must be at least 2 (a fault takes one out)")
    # SIGTERM (timeout, kill) must still stop the fleet: the run's `finally` does, on an exit.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    config = Config(args.out, args.duration_s, faults, args.workers, args.rps, args.warmup_s,
                    args.settle_s, args.interval_s, _model(args.model), not args.no_envoy,
                    args.seed, args.hold_scale, args.cycles)
    run(config)
    from benchmarks.chaos.report import write_report

    verdicts = write_report(args.out)
    return 0 if verdicts["pass"] else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _model(given: str | None) -> str:
    """The workers' model: `given`, else the demo model (kvserve's own default is the real
    SmolLM2, too slow for a fleet of faults on two cores)."""
    if given:
        return given
    from kvserve.runtime.demo_model import ensure_demo_model
    return str(ensure_demo_model())
