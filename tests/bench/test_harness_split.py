"""`kvserve bench` holds what a user runs against their own deployment; the development harnesses
are `python -m benchmarks`, and every benchmark command the docs show still parses with one of
the two."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from benchmarks.__main__ import build_parser as benchmarks_parser
from kvserve.bench.peers_env import peer_driver, vllm_unavailable
from kvserve.cli import build_parser as kvserve_parser

ROOT = Path(__file__).resolve().parents[2]
USER_BENCHES = {"kvcache", "engine", "serve", "gateway", "machine"}
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("kvserve bench ", "python -m benchmarks ")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_kvserve_bench_lists_only_the_user_benchmarks() -> None:
    assert set(_subcommands(_subcommands(kvserve_parser())["bench"])) == USER_BENCHES


def test_benchmarks_readme_lists_every_harness() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    names = set(_subcommands(benchmarks_parser()))
    assert names and not names & {"kvcache", "engine", "serve"}
    assert [n for n in sorted(names) if f"`python -m benchmarks {n} " not in readme] == []


def documented_commands(text: str) -> list[str]:
    """Benchmark command lines in fenced code blocks, continuation lines joined, comments cut."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(PREFIXES):
                commands.append(line)
    return commands


def test_the_command_finder_joins_continuations_and_cuts_comments() -> None:
    text = "```\nkvserve bench serve --a 1 \\\n  --b 2   # why\nkvserve up\n```\n`kvserve bench x`"
    assert documented_commands(text) == ["kvserve bench serve --a 1    --b 2"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_benchmark_command_parses(doc: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = []
    for line in documented_commands(doc.read_text(encoding="utf-8")):
        # Optional parts ([...]) are parsed too; a placeholder (N, URL) stands for a number.
        words = ["1" if re.fullmatch(r"[A-Z][A-Z_]*", w) else w
                 for w in shlex.split(line.replace("…", "x").replace("[", "").replace("]", ""))]
        parser, argv = ((kvserve_parser(), words[1:]) if words[0] == "kvserve"
                        else (benchmarks_parser(), words[3:]))
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append(f"{line}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert bad == []


def test_the_vllm_drivers_are_found_in_a_clone_and_their_absence_is_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    driver = peer_driver("vllm_kvcache_driver.py")
    assert driver == ROOT / "benchmarks" / "peers" / "vllm_kvcache_driver.py"
    assert peer_driver("no_such_driver.py") is None
    assert "run this from a clone" in (vllm_unavailable(None) or "")
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(tmp_path / "absent"))
    assert "vLLM is not installed" in (vllm_unavailable(driver) or "")
    (tmp_path / "python").touch()
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(tmp_path / "python"))
    assert vllm_unavailable(driver) is None
