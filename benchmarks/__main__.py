"""`python -m benchmarks COMMAND`: the development harnesses, one subcommand each.

The subcommands and their flags are those the harnesses had under `kvserve bench`; like the
`kvserve` command, every parser imports without torch (the engine loads when a command runs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import (
    attention_cli,
    chaos_cli,
    disagg_cli,
    gateway_cli,
    grammar_cli,
    knobs_cli,
    lora_cli,
    matmul_cli,
    one_stream_cli,
    precision_cli,
    preemption_cli,
    profile_cli,
    real_chats_cli,
    real_structured_cli,
    router_cpu_cli,
    sampling_cli,
    server_path_cli,
    structured_cli,
    text_capacity_cli,
    tp_cli,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="kvserve's development harnesses (benchmarks/README.md); `kvserve bench` "
                    "holds what a user runs against their own deployment.")
    commands = parser.add_subparsers(dest="bench", required=True, metavar="COMMAND")
    gateway_cli.add_parser(commands)
    profile_cli.add_parser(commands)
    disagg_cli.add_parser(commands)
    preemption_cli.add_parser(commands)
    tp_cli.add_parser(commands)
    attention_cli.add_parser(commands)
    matmul_cli.add_parser(commands)
    one_stream_cli.add_parser(commands)
    chaos_cli.add_parser(commands)
    router_cpu_cli.add_parser(commands)
    grammar_cli.add_parser(commands)
    structured_cli.add_parser(commands)
    lora_cli.add_parser(commands)
    server_path_cli.add_parser(commands)
    real_structured_cli.add_parser(commands)
    real_chats_cli.add_parser(commands)
    precision_cli.add_parser(commands)
    knobs_cli.add_parser(commands)
    text_capacity_cli.add_parser(commands)
    sampling_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
