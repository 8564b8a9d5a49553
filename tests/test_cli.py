"""The `kvserve` command line: a run imports only its own command's module, and the whole
parser still lists (and checks) every command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.cli import build_parser

# Modules a worker, gateway or doctor process has no use for unless its command is theirs.
OTHERS = ("kvserve.sim", "kvserve.bench", "kvserve.gateway", "kvserve.ops")

PROBE = """
import json, sys
from kvserve.cli import build_parser
build_parser(sys.argv[1]).parse_args(sys.argv[1:])
print(json.dumps(sorted(m for m in sys.modules if m.startswith({others!r}))))
"""


@pytest.mark.parametrize(("argv", "allowed"), [
    (["serve", "--model", "m"], ()),
    (["doctor", "http://127.0.0.1:1"], ("kvserve.ops",)),
    (["simulate", "--trace", "multi-tenant"], ("kvserve.sim", "kvserve.gateway")),  # its core
])
def test_a_command_imports_no_other_commands_modules(argv: list[str],
                                                     allowed: tuple[str, ...]) -> None:
    """Parsing `serve` must not import the gateway, simulator or benchmarks (each is ~0.5 s of
    imports a worker process would pay at start)."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(others=OTHERS), *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    strays = [m for m in loaded if not m.startswith(allowed)]
    assert not strays, f"`kvserve {argv[0]}` imported {strays}"


def test_the_whole_parser_lists_every_command_and_names_a_wrong_one() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for command in ("bench", "serve", "gateway", "up", "epp", "simulate", "doctor"):
        assert command in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["serv"])
    assert build_parser().parse_args(["bench", "machine"]).bench == "machine"
