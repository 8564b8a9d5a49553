"""The `kvserve` command.

Every subcommand's parser imports without torch (the engine loads only when a worker or an engine
benchmark runs), so `pip install kvserve` is enough for the gateway, the doctor and the simulator.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvserve import __version__
from kvserve.bench import engine_cli, kvcache_cli, machine, routers_cli, serve_cli
from kvserve.gateway.cli import epp as epp_command
from kvserve.gateway.cli import gateway as gateway_command
from kvserve.gateway.cli import up as up_command
from kvserve.ops import doctor_command
from kvserve.server import command as serve_command
from kvserve.sim import command as simulate_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM serving stack whose KV cache can be trusted."
    )
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="measure your own deployment: cache, engine, "
                                "server, gateway (development harnesses: benchmarks/)")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    kvcache_cli.add_parser(benches)
    engine_cli.add_parser(benches)
    machine.add_parser(benches)
    serve_cli.add_parser(benches)
    routers_cli.add_parser(benches)
    serve_command.add_parser(commands)
    gateway_command.add_parsers(commands)
    up_command.add_parser(commands)
    epp_command.add_parser(commands)
    simulate_command.add_parser(commands)
    doctor_command.add_parser(commands)
    return parser


# What `pip install 'kvserve[engine]'` adds; a command that needs one of them says so.
ENGINE_PACKAGES = frozenset({"torch", "safetensors", "huggingface_hub"})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
