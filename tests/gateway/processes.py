"""Real processes for the gateway's proxy tests: `kvserve serve` workers and `kvserve gateway`,
each on a free loopback port, always stopped (SIGINT, then SIGKILL) when their block ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ports import free_port
from tests.prefork import launch
from tests.shared_kernels import cache_with_shared_kernels

# Small enough to start in seconds and to run two of them on two cores.
WORKER_FLAGS = ("--num-kv-blocks", "512", "--max-model-len", "256", "--num-threads", "1")
ADMIN_KEY = "gateway-tests-admin-key"  # workers' admin routes (/debug/kv, /kv/events)
ADMIN_PATHS = ("/debug/", "/kv/")
START_TIMEOUT_S = 120.0  # generous: CI machines are often busy


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               describe: Callable[[], object] = lambda: "") -> None:
    """Poll `condition` every 50 ms; fail naming `what` (and `describe()`) on timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {describe()}")


class Process:
    """One `kvserve <command>` subprocess serving HTTP at `url`; output goes to `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{self.port}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   KVSERVE_CACHE=str(cache_with_shared_kernels(log_dir / "cache")))
        for key in ("KVSERVE_API_KEY", "KVSERVE_ADMIN_KEY"):
            env.pop(key, None)
        command = [sys.executable, "-m", "kvserve.cli", *argv, "--host", "127.0.0.1",
                   "--port", str(self.port)]
        self.proc = launch(command, env, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, ready: Callable[[httpx.Response], bool],
                   timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once GET /health satisfies `ready`; fail with the log if the process dies."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            with contextlib.suppress(httpx.TransportError):
                if ready(httpx.get(f"{self.url}/health", timeout=1.0)):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.log_path.name} not ready after {timeout_s}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, its sockets reset."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10.0)

    def interrupt(self) -> None:
        """SIGINT: begin a graceful shutdown (`stop` waits for it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (graceful), then SIGKILL if it has not exited within `timeout_s`."""
        self.interrupt()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def get(self, path: str, **kwargs: object) -> httpx.Response:
        """GET `path`; an admin route with the tests' admin key unless headers are given."""
        if path.startswith(ADMIN_PATHS) and "headers" not in kwargs:
            kwargs["headers"] = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.get(f"{self.url}{path}", timeout=10.0, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> Metrics:
        response = self.get("/metrics")
        response.raise_for_status()
        return Metrics(response.text)


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


@contextlib.contextmanager
def running_workers(model_dir: Path, log_dir: Path, count: int,
                    flags: Sequence[str] = ()) -> Iterator[list[Process]]:
    """`count` `kvserve serve` workers (started together, so they load in parallel), healthy."""
    with running_worker_set(model_dir, log_dir, [flags] * count) as workers:
        yield workers


@contextlib.contextmanager
def running_worker_set(model_dir: Path, log_dir: Path,
                       flag_sets: Sequence[Sequence[str]]) -> Iterator[list[Process]]:
    """One `kvserve serve` worker per entry of `flag_sets` (its extra flags), started together."""
    workers: list[Process] = []
    try:
        for i, flags in enumerate(flag_sets):
            keys = () if "--admin-key" in flags else ("--admin-key", ADMIN_KEY)
            workers.append(Process(f"worker{i}", ["serve", "--model", str(model_dir),
                                                  *WORKER_FLAGS, *keys, *flags], log_dir))
        for worker in workers:
            worker.wait_ready(lambda r: r.status_code == 200)
        yield workers
    finally:
        for worker in workers:  # all at once: each takes a second or two to drain
            worker.interrupt()
        for worker in workers:
            worker.stop()


@contextlib.contextmanager
def running_gateway(worker_urls: Sequence[str], log_dir: Path, flags: Sequence[str] = (),
                    expect_healthy: int | None = None,
                    trust_tenant_header: bool = True) -> Iterator[Process]:
    """`kvserve gateway` in front of `worker_urls`, up once /health reports `expect_healthy`
    healthy workers (default: all of them). The tests name tenants in X-Tenant-Id, as an
    authenticating layer in front would (`trust_tenant_header`); the gateway holds the workers'
    admin key unless `flags` give one."""
    want = len(worker_urls) if expect_healthy is None else expect_healthy
    extra = ["--trust-tenant-header"] if trust_tenant_header else []
    if "--admin-key" not in flags:
        extra += ["--admin-key", ADMIN_KEY]
    argv = ["gateway", *(arg for url in worker_urls for arg in ("--worker", url)), *extra,
            *flags]
    gateway = Process("gateway", argv, log_dir)
    try:
        gateway.wait_ready(lambda r: r.json().get("healthy_workers") == want)
        yield gateway
    finally:
        gateway.stop()
