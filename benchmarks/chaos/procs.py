"""The harness's subprocesses: one `kvserve ...` (or Envoy) process with its log, readiness by an
HTTP probe, and the /proc figures recorded for it (RSS, open fds, threads)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx


def kvserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


class Proc:
    """One process started from `argv` (its output in `log_dir/name.log`, appended across
    restarts); `start` again after it died starts the same command anew."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: dict[str, str] | None = None, probe: str | None = None) -> None:
        self.name, self.argv, self.log_dir = name, list(argv), log_dir
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.probe = probe  # a URL that answers 200 once the process is ready
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"\n--- start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**self.env, **(extra_env or {})},
                                         start_new_session=True)
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None

    def ready(self) -> bool:
        if not self.alive() or self.probe is None:
            return self.alive()
        try:
            return httpx.get(self.probe, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float, ready: Callable[[], bool] | None = None) -> float:
        """Seconds until ready; RuntimeError (with the log's tail) if it dies or times out."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            if (ready or self.ready)():
                return time.monotonic() - began
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def signal(self, sig: signal.Signals) -> None:
        if self.pid is not None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to its whole process group (a TP worker's ranks die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30.0)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGCONT (in case it was stopped) and SIGINT, then SIGKILL after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def proc_stats(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open file descriptors and threads of `pid` and its children, from /proc."""
    pids = [pid, *_children(pid)]
    rss = fds = threads = 0.0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return {"rss_mib": rss, "fds": fds, "threads": threads} if rss else None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            for child in map(int, text):
                out += [child, *_children(child)]
    return out
