"""`kvserve bench gateway` on workers the user names: real `kvserve serve` processes started
here, a real `kvserve gateway` in front of them, and SGLang's router skipped with a message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.bench.server_launch import KVSERVE, LaunchedServer, LaunchSpec
from kvserve.cli import main
from kvserve.model import write_random_checkpoint
from tests.bench.tiny_model import TINY


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("routers") / "tiny", TINY, seed=5)


@pytest.fixture(scope="module")
def worker_urls(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    spec = LaunchSpec(model_dir=model_dir, served_model_name="yours", kv_cache_bytes=1 << 22,
                      max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512,
                      num_threads=1)
    logs = tmp_path_factory.mktemp("logs")
    with LaunchedServer(KVSERVE, spec, logs, 60.0) as a, LaunchedServer(KVSERVE, spec, logs,
                                                                         60.0) as b:
        yield [a.url, b.url]


def test_routers_run_side_by_side_on_your_workers_each_from_a_cold_cache(
        worker_urls: list[str], model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PEERS", str(tmp_path / "no-peers"))
    monkeypatch.delenv("KVSERVE_SGLANG_ROUTER", raising=False)
    out = tmp_path / "gw.json"
    argv = ["bench", "gateway", "--worker", worker_urls[0], "--worker", worker_urls[1],
            "--routers", "ideal,kvserve:prefix_hash,kvserve:round_robin,sglang:cache_aware",
            "--model",
            str(model_dir), "--tenants", "3", "--requests", "12", "--rate", "6",
            "--prefix-tokens", "512,768", "--suffix-tokens", "16,32", "--output-tokens", "4",
            "--json", str(out)]
    assert main(argv) == 0
    assert "SGLang's router is not installed" in capsys.readouterr().err
    runs = {r["router"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"ideal", "kvserve:prefix_hash", "kvserve:round_robin"}
    for run in runs.values():
        # Every request reached a worker under the model name its /v1/models lists.
        assert run["completed"] == run["requests"] == 12 and run["lost"] == 0, run
        assert sum(run["worker_shares"]) == pytest.approx(1.0)
        # round_robin meets workers that prefix_hash warmed with the same tenant salts, yet its
        # first request misses: each run's prompts are its own. Later visits of a tenant hit.
        cached = {r[0]: r[3] for r in run["per_request"]}
        assert cached[0] == 0 and sum(c > 0 for c in cached.values()) >= 3, cached
        assert 0.0 < run["hit_rate"] < 1.0
    assert runs["kvserve:prefix_hash"]["cpu_ms_per_request"]["router"] > 0.0


def test_without_workers_a_local_fleet_serves_the_runs(
        model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "local.json"
    assert main(["bench", "gateway", "--workers", "1", "--routers", "ideal,kvserve:round_robin",
                 "--model", str(model_dir), "--tenants", "2", "--requests", "6", "--rate", "6",
                 "--prefix-tokens", "512,600", "--suffix-tokens", "16,32", "--output-tokens",
                 "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["served_model_name"] is None
    runs = {r["router"]: r for r in report["runs"]}
    assert set(runs) == {"ideal", "kvserve:round_robin"}
    for run in runs.values():
        assert run["completed"] == 6 and run["hit_rate"] > 0.0, run
        assert "workers" in run["cpu_ms_per_request"]  # the fleet's own processes, measured


def test_a_worker_that_names_no_model_is_a_clear_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gateway", "--worker", "http://127.0.0.1:9", "--routers",
                 "ideal"]) == 2
    assert "--served-model-name" in capsys.readouterr().err


def test_a_bad_router_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gateway", "--routers", "nginx:round_robin"]) == 2
    assert "ideal or KIND:POLICY" in capsys.readouterr().err.replace("'", "")
