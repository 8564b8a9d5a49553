"""A real `kvserve serve` process on a free loopback port, and /metrics in numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ports import free_port
from tests.prefork import launch
from tests.shared_kernels import cache_with_shared_kernels

# Small enough to start in seconds and run on two cores; the same for every server here.
BASE_FLAGS = (
    "--num-kv-blocks", "512", "--block-size", "16", "--max-model-len", "256",
    "--max-num-seqs", "32", "--num-threads", "1", "--audit-interval-steps", "10",
    "--idle-audit-interval-s", "0",
)
START_TIMEOUT_S = 60.0
ADMIN_KEY = "server-tests-admin-key"  # every test server's admin routes (/debug/kv, /kv/*)


class ServerProcess:
    """One `kvserve serve` subprocess; stdout and stderr go to `log_path`."""

    def __init__(self, model_dir: Path, work_dir: Path, flags: Sequence[str] = (),
                 api_key: str | None = None, admin_key: str | None = ADMIN_KEY,
                 command: Sequence[str] | None = None) -> None:
        """`command`: the whole `kvserve serve` line instead of `--model model_dir`, the base
        flags and `flags` (the loopback host and a free port are appended to it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / f"server-{self.port}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   KVSERVE_CACHE=str(cache_with_shared_kernels(work_dir / "cache")))
        env.pop("KVSERVE_API_KEY", None)
        env.pop("KVSERVE_ADMIN_KEY", None)
        argv = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), *BASE_FLAGS, *flags]
        if command is not None:
            argv = [sys.executable, "-m", "kvserve.cli", "serve", *command,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key is not None:
            argv += ["--api-key", api_key]
        if admin_key is not None and command is None:  # a given line runs as it is
            argv += ["--admin-key", admin_key]
        self.proc = launch(argv, env, self.log_path)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once /health answers 200; fail with the server's output if it dies first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvserve serve not healthy after {timeout_s}s:\n{self.log()}")

    def interrupt(self) -> None:
        """SIGINT: start a graceful drain (`stop` waits for it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGINT (graceful drain), then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10.0)
        return self.proc.returncode

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60.0,
                            **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        response.raise_for_status()
        return Metrics(response.text)

    def debug_kv(self) -> dict[str, object]:
        response = httpx.get(f"{self.url}/debug/kv", timeout=10.0,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        response.raise_for_status()
        return response.json()


class Metrics:
    """One /metrics scrape. `value(name, **labels)` sums the samples that match."""

    def __init__(self, text: str) -> None:
        self.samples = [(s.name, s.labels, s.value)
                        for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        matches = [v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == want for k, want in labels.items())]
        if not matches:
            raise KeyError(f"no sample {name} {labels} in /metrics")
        return sum(matches)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               describe: Callable[[], object] = lambda: "") -> None:
    """Poll `condition` every 50 ms; fail naming `what` (and `describe()`) on timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {describe()}")
