"""tests/prefork.py: a forked `kvserve serve` is a real worker with Popen's exit codes, and a
worker whose environment the zygote's imports would have read differently starts for itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.ports import free_port
from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config
from tests.prefork import ForkedProcess, launch
from tests.server.harness import BASE_FLAGS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("prefork") / "m", base_config(),
                                   seed=7)


def _serve(model_dir: Path, log: Path, env: dict[str, str]
           ) -> tuple[subprocess.Popen[bytes] | ForkedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), *BASE_FLAGS]
    return launch(argv, env, log), f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen[bytes] | ForkedProcess, url: str, log: Path) -> None:
    for _ in range(600):
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.1)
    raise AssertionError(log.read_text())


@pytest.mark.skipif(os.environ.get("KVSERVE_TEST_PREFORK") == "0", reason="prefork turned off")
def test_a_forked_worker_serves_logs_and_exits_like_a_process(model_dir: Path,
                                                              tmp_path: Path) -> None:
    env = dict(os.environ)
    first, url = _serve(model_dir, tmp_path / "a.log", env)
    second, _ = _serve(model_dir, tmp_path / "b.log", env)
    assert isinstance(first, ForkedProcess) and isinstance(second, ForkedProcess)
    _wait_healthy(first, url, tmp_path / "a.log")
    assert first.pid != second.pid and os.getpid() not in (first.pid, second.pid)
    reply = httpx.post(f"{url}/v1/completions", json={
        "model": str(model_dir), "prompt": "hello", "max_tokens": 3}, timeout=60.0)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    first.send_signal(signal.SIGINT)  # a graceful drain: exit 0, its log complete
    assert first.wait(60.0) == 0
    assert f"kvserve serving {model_dir} at {url}" in (tmp_path / "a.log").read_text()
    second.kill()
    assert second.wait(30.0) == -signal.SIGKILL
    second.kill()  # reaped: nothing is signalled, nothing fails


def test_an_import_time_variable_starts_the_worker_for_itself(model_dir: Path,
                                                              tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1" if os.environ.get("OMP_NUM_THREADS") != "1"
               else "2")
    proc, url = _serve(model_dir, tmp_path / "c.log", env)
    try:
        assert isinstance(proc, subprocess.Popen)
        _wait_healthy(proc, url, tmp_path / "c.log")
    finally:
        proc.kill()
        proc.wait(30.0)
