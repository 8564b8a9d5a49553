"""kvserve started through its own command line, for the harnesses that must see it only as a
user does (CLI and HTTP): one `kvserve serve` or a `kvserve up` fleet, on free ports, its output
in a log file, stopped with SIGINT (then killed) when the `with` block ends.

Why not `kvserve.bench.server_launch`: the real-weight checks must not depend on kvserve's
internals, which change under them; a command line and its printed URLs are the contract.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from benchmarks import with_repo_on_path
from benchmarks.ports import free_port

# `kvserve up` prints "... gateway (POLICY) at URL → W1, W2" once its workers answer.
_UP_LINE = re.compile(r"gateway \(\S+\) at (\S+) → (.+)$", re.MULTILINE)


class FleetError(RuntimeError):
    """kvserve did not start: the message has the command and the end of its log."""


class CliProcess:
    """`python -m kvserve.cli ARGS` with its output in `log_path`; `url` is where it answers
    (the gateway for `up`) and `worker_urls` the workers behind it (itself for `serve`)."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 600.0) -> None:
        self.args = args
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.worker_urls: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def serve(cls, model: str, log_path: Path, extra: list[str]) -> CliProcess:
        port = free_port()
        proc = cls(["serve", "--model", model, "--port", str(port), *extra], log_path)
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    @classmethod
    def up(cls, model: str, log_path: Path, extra: list[str]) -> CliProcess:
        return cls(["up", "--model", model, "--port", str(free_port()), *extra], log_path)

    def __enter__(self) -> Self:
        cmd = [sys.executable, "-m", "kvserve.cli", *self.args]
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=with_repo_on_path(os.environ))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise FleetError(f"`kvserve {' '.join(self.args)}` exited with "
                                 f"{self._proc.returncode}:\n{self._log_tail()}")
            if self.args[0] == "up":
                found = _UP_LINE.search(self.log_path.read_text(errors="replace"))
                if found:
                    self.url = found.group(1)
                    self.worker_urls = [u.strip() for u in found.group(2).split(",")]
                    if _answers(f"{self.url}/health"):
                        return
            elif _answers(f"{self.url}/health"):
                self.worker_urls = [self.url]
                return
            time.sleep(1.0)
        raise FleetError(f"`kvserve {' '.join(self.args)}` did not answer within "
                         f"{self.startup_timeout_s:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def counter_total(metrics_text: str, name: str) -> float:
    """The sum over labels of Prometheus counter `name` (e.g. `vllm:prefix_cache_hits_total`)
    in a /metrics page; 0 when absent."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
