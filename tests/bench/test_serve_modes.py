"""`kvserve bench serve --launch NAME[:MODE]`: parsing, each mode's command line, the report's
RSS fields, and one launched kvserve in a packed mode (a real process; no peer needed)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvserve.bench.launch_target import LaunchTarget, parse_launch
from kvserve.bench.serve_load import LevelSummary
from kvserve.bench.serve_report import ServerRun, json_rows, print_table
from kvserve.bench.server_launch import LaunchError, LaunchSpec, server_command
from kvserve.cli import build_parser, main
from kvserve.model import write_random_checkpoint
from kvserve.server.command import engine_args_from
from tests.bench.tiny_model import TINY as SMALL

# The demo tokenizer on a much smaller model, its vocabulary padded to a multiple of 16 (what
# the packed q8_0 lm_head needs).
TINY = SMALL | {"vocab_size": 752}


@pytest.mark.parametrize(("entry", "name", "mode", "label"), [
    ("kvserve", "kvserve", None, "kvserve"),
    ("kvserve:float32", "kvserve", "float32", "kvserve:float32"),
    ("kvserve:bfloat16", "kvserve", "bfloat16", "kvserve:bfloat16"),
    ("kvserve:q8_0", "kvserve", "q8_0", "kvserve:q8_0"),
    (" KVserve : Q4_1 ", "kvserve", "q4_1", "kvserve:q4_1"),
    ("kvserve:gguf", "kvserve", "gguf", "kvserve:gguf"),
    ("vllm", "vllm", None, "vllm"),
    ("vllm:float32", "vllm", "float32", "vllm:float32"),
    ("vllm:bfloat16", "vllm", "bfloat16", "vllm:bfloat16"),
    ("llamacpp", "llamacpp", None, "llamacpp"),
])
def test_every_valid_entry_parses(entry: str, name: str, mode: str | None, label: str) -> None:
    target = LaunchTarget.parse(entry)
    assert (target.name, target.mode, target.label) == (name, mode, label)


@pytest.mark.parametrize(("value", "message"), [
    ("sglang", "--launch sglang: unknown server 'sglang': choose from "
               "kvserve[:float32|bfloat16|q8_0|q4_1|gguf|w8a8]; vllm[:float32|bfloat16]; "
               "llamacpp (no mode)"),
    ("kvserve:int4", "unknown mode 'int4' for kvserve: choose from "
                     "float32|bfloat16|q8_0|q4_1|gguf"),
    ("kvserve:", "unknown mode '' for kvserve"),
    ("vllm:q4_1", "unknown mode 'q4_1' for vllm: choose from float32|bfloat16"),
    ("vllm:gguf", "for vllm: choose from float32|bfloat16"),
    ("kvserve,llamacpp:q8_0", "--launch llamacpp:q8_0: llamacpp takes no mode"),
])
def test_bad_names_and_modes_name_the_choices(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_launch(value)


def test_parse_keeps_order_and_old_inputs_and_drops_what_runs_twice() -> None:
    assert [t.label for t in parse_launch("kvserve, vllm,,kvserve")] == ["kvserve", "vllm"]
    assert parse_launch("") == []
    value = "kvserve:float32,kvserve:q4_1,vllm:bfloat16,llamacpp,kvserve:q4_1,kvserve,vllm:float32"
    assert [t.label for t in parse_launch(value)] == [
        "kvserve:float32", "kvserve:q4_1", "vllm:bfloat16", "llamacpp", "vllm:float32"]


@pytest.fixture()
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LaunchSpec:
    python = tmp_path / "python"
    python.touch()
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", str(python))
    return LaunchSpec(model_dir=tmp_path / "model", served_model_name="m",
                      kv_cache_bytes=1 << 20, max_model_len=512, max_num_seqs=4,
                      max_num_batched_tokens=256, num_threads=2,
                      gguf_file=tmp_path / "m.gguf", extra_args=("--seed", "3"))


def flag_values(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]


@pytest.mark.parametrize(("entry", "server", "dtypes", "quantization"), [
    ("kvserve", "kvserve.cli", ["float32"], []),
    ("kvserve:float32", "kvserve.cli", ["float32"], []),
    ("kvserve:bfloat16", "kvserve.cli", ["bfloat16"], []),
    ("kvserve:q8_0", "kvserve.cli", ["float32"], ["q8_0"]),
    ("kvserve:q4_1", "kvserve.cli", ["float32"], ["q4_1"]),
    ("kvserve:w8a8", "kvserve.cli", ["bfloat16"], ["w8a8"]),
    ("vllm", "vllm.entrypoints.openai.api_server", ["float32"], []),
    ("vllm:bfloat16", "vllm.entrypoints.openai.api_server", ["bfloat16"], []),
])
def test_each_mode_sets_one_dtype_and_its_quantization(
        spec: LaunchSpec, entry: str, server: str, dtypes: list[str],
        quantization: list[str]) -> None:
    cmd, _ = server_command(LaunchTarget.parse(entry), spec, 8000)
    assert cmd[2] == server
    assert flag_values(cmd, "--dtype") == dtypes  # once: no float32 after a bfloat16
    assert flag_values(cmd, "--quantization") == quantization
    assert flag_values(cmd, "--model") == [str(spec.model_dir)]
    assert cmd[-2:] == ["--seed", "3"]  # the extra args still come last


@pytest.mark.parametrize(("entry", "model", "dtype", "quantization"), [
    ("kvserve:float32", "model", "float32", None),
    ("kvserve:bfloat16", "model", "bfloat16", None),
    ("kvserve:q8_0", "model", "float32", "q8_0"),
    ("kvserve:q4_1", "model", "float32", "q4_1"),
    ("kvserve:gguf", "m.gguf", "float32", "gguf"),
    ("kvserve:w8a8", "model", "bfloat16", "w8a8"),
])
def test_kvserve_reads_each_command_line_as_meant(spec: LaunchSpec, entry: str, model: str,
                                                  dtype: str, quantization: str | None) -> None:
    cmd, _ = server_command(LaunchTarget.parse(entry), spec, 8000)
    assert cmd[1:4] == ["-m", "kvserve.cli", "serve"]
    args = engine_args_from(build_parser().parse_args(cmd[3:]))
    assert (Path(str(args.model)).name, args.dtype, args.quantization) == (
        model, dtype, quantization)


def test_kvserve_gguf_serves_the_gguf_file_itself(spec: LaunchSpec) -> None:
    cmd, _ = server_command(LaunchTarget.parse("kvserve:gguf"), spec, 8000)
    assert flag_values(cmd, "--model") == [str(spec.gguf_file)]
    assert flag_values(cmd, "--quantization") == ["gguf"]
    assert flag_values(cmd, "--dtype") == ["float32"]
    with pytest.raises(LaunchError, match=r"kvserve:gguf reads GGUF files only: pass --gguf"):
        server_command(LaunchTarget.parse("kvserve:gguf"), replace(spec, gguf_file=None), 8000)


def test_bare_names_and_unchecked_targets(spec: LaunchSpec) -> None:
    assert server_command("kvserve", spec, 8000) == server_command(
        LaunchTarget("kvserve", "float32"), spec, 8000)
    with pytest.raises(LaunchError, match="unknown mode 'q4_1' for vllm"):
        server_command(LaunchTarget("vllm", "q4_1"), spec, 8000)
    with pytest.raises(LaunchError, match="unknown server 'tgi'"):
        server_command("tgi", spec, 8000)


def test_a_gguf_mode_without_gguf_is_refused_before_any_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--launch", "kvserve,kvserve:gguf", "--model",
                 str(tmp_path / "unused")])
    assert code == 2 and "--launch kvserve:gguf reads a GGUF file: pass --gguf FILE" in (
        capsys.readouterr().err.replace("\n", ""))


def level(c: int) -> LevelSummary:
    return LevelSummary.from_records(c, [], 1.0)


def test_rss_is_reported_per_launched_server_and_dash_for_urls(
        capsys: pytest.CaptureFixture[str]) -> None:
    runs = [ServerRun("http://w1:8000", "http://w1:8000", [level(1)]),
            ServerRun("kvserve:q4_1", "http://127.0.0.1:1", [level(1)],
                      info={"startup_s": 1.0, "start_rss_mib": 300.4, "peak_rss_mib": 412.6})]
    rows = json_rows(runs, [1], {})
    assert [(r["start_rss_mib"], r["peak_rss_mib"]) for r in rows] == [
        (None, None), (300.4, 412.6)]
    print_table(runs, [1], "t")
    out = capsys.readouterr().out
    assert "http://w1:8000: RSS -" in out
    assert "kvserve:q4_1: RSS 300 MiB after start, peak 413 MiB" in out


def test_a_launched_kvserve_in_a_packed_mode_reports_its_label_and_rss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = write_random_checkpoint(tmp_path / "tiny", TINY, seed=5)
    code = main(["bench", "serve", "--launch", "kvserve:q8_0", "--model", str(model_dir),
                 "--concurrency", "2", "--num-prompts", "3", "--input-len", "16",
                 "--output-len", "4", "--threads", "1", "--max-model-len", "64",
                 "--kv-cache-memory-bytes", str(1 << 22), "--startup-timeout", "120", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert len(rows) == 1 and "skipped" not in rows[0], (rows, captured.err[-3000:])
    row = rows[0]
    assert row["server"] == "kvserve:q8_0" and row["completed"] == 3
    # a kvserve process holds torch and the model: tens of MiB at the very least
    assert 50 < row["start_rss_mib"] <= row["peak_rss_mib"]


def test_a_server_stopped_part_way_keeps_the_levels_it_measured(
        capsys: pytest.CaptureFixture[str]) -> None:
    why = "c=16: every warm-up request failed (ConnectError); the levels before it stand"
    runs = [ServerRun("kvserve", "http://a", [level(1), level(4), level(16)]),
            ServerRun("llamacpp", "http://b", [level(1), level(4)], skipped=why),
            ServerRun("vllm", None, [], skipped="did not start")]
    rows = json_rows(runs, [1, 4, 16], {})
    by = {(r["server"], r["concurrency"]): r for r in rows}
    assert set(by[("kvserve", 1)]["ratios_vs"]) == {"llamacpp"}
    assert "ratios_vs" not in by[("kvserve", 16)]
    assert by[("llamacpp", 4)]["completed"] == 0 and by[("llamacpp", 4)]["stopped_later"] == why
    assert by[("llamacpp", 16)]["skipped"] == why
    assert by[("vllm", 1)]["skipped"] == "did not start"
    print_table(runs, [1, 4, 16], "t")
    out = capsys.readouterr().out
    assert f"llamacpp: stopped: {why}" in out and "vllm: skipped: did not start" in out
    assert out.count("kvserve/llamacpp") == 2
