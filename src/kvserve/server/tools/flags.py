"""`kvserve serve`'s tool-call flags and the settings they make (light: no torch, so the CLI
imports it before a model loads)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvserve.server.tools.parsers import PARSERS


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    """`kvserve serve`'s tool-call flags, with vLLM's names and meanings."""
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (the default when tools are given): the "
                        "model's text is parsed into tool_calls by --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how 'auto' tool calls are written: hermes/qwen "
                        "(<tool_call>{...}</tool_call>) or llama3_json ({\"name\", "
                        "\"parameters\"})")


def check_tool_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError for an inconsistent pair of tool flags."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(sorted(PARSERS))})")


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's tool-call configuration (from the flags above)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
