"""The `kvserve` command.

Every subcommand's parser imports without torch (the engine loads only when a worker or an engine
benchmark runs), so `pip install kvserve` is enough for the gateway, the doctor and the simulator.
A run imports only its own command's module: every worker, gateway and doctor process would
otherwise pay for importing all the others (the gateway, the simulator, the benchmarks).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvserve import __version__

# Each command: its module and the function there that adds its parser, in `--help`'s order.
_BENCHES = (
    ("kvcache", "kvserve.bench.kvcache_cli", "add_parser"),
    ("engine", "kvserve.bench.engine_cli", "add_parser"),
    ("machine", "kvserve.bench.machine", "add_parser"),
    ("serve", "kvserve.bench.serve_cli", "add_parser"),
    ("routers", "kvserve.bench.routers_cli", "add_parser"),
)
_COMMANDS = (
    ("serve", "kvserve.server.command", "add_parser"),
    ("gateway", "kvserve.gateway.cli.gateway", "add_parsers"),
    ("up", "kvserve.gateway.cli.up", "add_parser"),
    ("epp", "kvserve.gateway.cli.epp", "add_parser"),
    ("simulate", "kvserve.sim.command", "add_parser"),
    ("doctor", "kvserve.ops.doctor_command", "add_parser"),
)


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser], module: str,
         adder: str) -> None:
    getattr(importlib.import_module(module), adder)(sub)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (`command` given) only that command's parser: a run needs
    no other command's module."""
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM serving stack whose KV cache can be trusted."
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in (None, "bench"):
        bench = commands.add_parser("bench", help="measure your own deployment: cache, engine, "
                                    "server, gateway (development harnesses: benchmarks/)")
        benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
        for _, module, adder in _BENCHES:
            _add(benches, module, adder)
    for name, module, adder in _COMMANDS:
        if command in (None, name):
            _add(commands, module, adder)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names, where it names a known one first (else None: the whole parser
    answers, with its help or its error)."""
    known = {"bench", *(name for name, _, _ in _COMMANDS)}
    return argv[0] if argv and argv[0] in known else None


# What `pip install 'kvserve[engine]'` adds; a command that needs one of them says so.
ENGINE_PACKAGES = frozenset({"torch", "safetensors", "huggingface_hub"})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ENGINE_PACKAGES:
            raise
        print(f"kvserve {args.command}: this command runs the engine, which needs {exc.name}: "
              "install it with pip install 'kvserve[engine]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
