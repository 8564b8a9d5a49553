"""Real server processes for the ops tests: `kvserve serve` workers (optionally with the planted
leak of tests/ops/leaky_worker.py) and `kvserve gateway`, each on a free loopback port. A
`Fleet` stops everything it started (SIGINT, then SIGKILL), so no test leaves a process behind."""

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

from benchmarks.ports import free_port
from tests.prefork import launch
from tests.shared_kernels import cache_with_shared_kernels

START_TIMEOUT_S = 120.0
ADMIN_KEY = "ops-tests-admin-key"  # the workers' /debug/kv, which the doctor reads
# 64 MiB of KV cache (a test's own --num-kv-blocks wins): zeroing the default GiB costs each
# worker ~1 CPU-second at start.
TINY_WORKER = ("--max-model-len", "256", "--num-threads", "1", "--block-size", "16",
               "--drain-timeout", "1", "--admin-key", ADMIN_KEY,
               "--kv-cache-memory-bytes", str(64 << 20))


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Server:
    """One server subprocess (`python -m <module> <argv> --host --port`), logging to a file."""

    def __init__(self, name: str, module: str, argv: Sequence[str], log_dir: Path,
                 extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.num_workers = 0  # a gateway's
        self.interrupted = False
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   KVSERVE_CACHE=str(cache_with_shared_kernels(log_dir / "cache")),
                   **(extra_env or {}))
        for key in ("KVSERVE_API_KEY", "KVSERVE_ADMIN_KEY"):
            env.pop(key, None)
        command = [sys.executable, "-m", module, *argv, "--host", "127.0.0.1",
                   "--port", str(self.port)]
        self.proc = launch(command, env, self.log_path)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, ready: Callable[[httpx.Response], bool],
                   timeout_s: float = START_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            with contextlib.suppress(httpx.TransportError, ValueError):
                if ready(httpx.get(f"{self.url}/health", timeout=1.0)):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.log_path.name} not ready after {timeout_s}s:\n"
                           f"{self.log()}")

    def interrupt(self) -> None:
        """SIGINT once: a graceful shutdown (a second one would force it)."""
        if self.proc.poll() is None and not self.interrupted:
            self.proc.send_signal(signal.SIGINT)
            self.interrupted = True

    def stop(self, timeout_s: float = 10.0) -> None:
        self.interrupt()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10.0)

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text


class Fleet:
    """Starts workers (in parallel) and gateways; `close` stops every one of them."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[Server] = []

    def workers(self, count: int, flags: Sequence[str] = (), leaky: bool = False,
                wait: bool = True) -> list[Server]:
        """`count` workers, healthy unless not `wait` (then call `wait_ready`); `leaky` plants
        the skip-free-on-abort fault."""
        module = "tests.ops.leaky_worker" if leaky else "kvserve.cli"
        argv = ([] if leaky else ["serve"]) + ["--model", str(self.model_dir), *TINY_WORKER,
                                               *flags]
        started = [Server("leaky" if leaky else "worker", module, argv, self.log_dir)
                   for _ in range(count)]
        self.servers += started
        if wait:
            self.wait_ready(started)
        return started

    @staticmethod
    def wait_ready(workers: Sequence[Server]) -> None:
        for server in workers:
            server.wait_ready(lambda r: r.status_code == 200)

    def gateway(self, workers: Sequence[Server], flags: Sequence[str] = (),
                wait: bool = True) -> Server:
        """A gateway in front of `workers`, ready once it sees them all healthy (if `wait`)."""
        argv = ["gateway", *(a for w in workers for a in ("--worker", w.url)),
                "--trust-tenant-header", *flags]  # tenants named as a layer in front would
        server = Server("gateway", "kvserve.cli", argv, self.log_dir)
        server.num_workers = len(workers)
        self.servers.append(server)
        if wait:
            self.wait_gateways([server])
        return server

    @staticmethod
    def wait_gateways(gateways: Sequence[Server]) -> None:
        for server in gateways:
            want = server.num_workers
            server.wait_ready(lambda r, want=want: r.json().get("healthy_workers") == want)

    def close(self) -> None:
        """Gateways first (they hold connections to the workers), then every worker at once."""
        gateways = [s for s in self.servers if s.num_workers]
        for group in (gateways, [s for s in self.servers if not s.num_workers]):
            for server in group:
                server.interrupt()
            for server in group:
                server.stop()


@contextlib.contextmanager
def fleet(model_dir: Path, log_dir: Path) -> Iterator[Fleet]:
    started = Fleet(model_dir, log_dir)
    try:
        yield started
    finally:
        started.close()
