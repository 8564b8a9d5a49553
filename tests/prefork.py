"""`kvserve serve` workers for the tests, forked from a process that has already imported them.

Contract: `launch(argv, env, log_path)` starts `argv` with stdout and stderr to `log_path`
(truncated) and stdin from /dev/null, and returns a `subprocess.Popen` or, for
`[sys.executable, "-m", "kvserve.cli", "serve", ...]`, a `ForkedProcess` with the same
`pid`, `poll`, `wait`, `send_signal`, `terminate`, `kill` and `returncode`. A forked worker
is a fresh process running `kvserve.cli.main(argv[3:])` with `env` as its environment, its
own pid (signals reach it directly) and Popen's exit codes (-N when killed by signal N). Only
its command line differs: `ps` shows the zygote's (`python tests/prefork.py`), so find a
worker by its pid, never by `pgrep -f`.

Why: a tiny worker spends three quarters of its start-up CPU importing torch, the engine and
the HTTP app (~3 CPU-seconds), and the suite starts dozens of them on a 2-core CI machine. One
zygote a test process imports them once (single-threaded, checked) and forks each worker.

A worker still starts as a real process (`subprocess.Popen`) where forking could change what
it does: an environment that differs from the zygote's in a variable read at import time
(`_IMPORT_TIME_ENV`), or `KVSERVE_TEST_PREFORK=0` (set it to debug a worker's start).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# Read once, at import (by libgomp, the allocator, Python or kvserve's kernel loader): a worker
# whose value differs from the zygote's must import for itself.
_IMPORT_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "LD_", "MALLOC_", "GLIBC_", "PYTHON",
                    "TORCH", "KVSERVE_CPU_KERNELS")
_IGNORED_ENV = frozenset({"PYTHONUNBUFFERED"})  # a forked worker's stdio is line-buffered
_POLL_S = 0.02
# What `kvserve serve` imports before it reads its flags (the rest it imports itself).
_PREIMPORTED = ("kvserve.cli", "kvserve.server.command", "kvserve.runtime", "kvserve.server.app")


class ForkedProcess:
    """A worker forked by the zygote: Popen's process-control surface, by pid."""

    def __init__(self, zygote: _Zygote, pid: int, args: Sequence[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.request({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the zygote has reaped (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The client side: one zygote subprocess, JSON lines over its stdin and stdout."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, text=True)
        self.lock = threading.Lock()
        try:
            self.ok = bool(self.request({"op": "hello"}).get("ok"))
        except RuntimeError:  # it could not import the server: every worker starts for itself
            self.ok = False

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote ended (exit {self.proc.poll()})")
        return json.loads(line)

    def compatible(self, env: Mapping[str, str]) -> bool:
        changed = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)}
        return not any(k.startswith(_IMPORT_TIME_ENV) for k in changed - _IGNORED_ENV)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the zygote kills what it still runs, then exits
        self.proc.wait(30)


_zygote: _Zygote | None = None


def _the_zygote() -> _Zygote | None:
    global _zygote
    if _zygote is None:
        _zygote = _Zygote()
        atexit.register(_zygote.close)
    return _zygote if _zygote.ok else None


def launch(argv: Sequence[str], env: Mapping[str, str],
           log_path: Path) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start `argv` (see the module doc); the caller stops it by its pid."""
    forkable = (list(argv[:4]) == [sys.executable, "-m", "kvserve.cli", "serve"]
                and os.environ.get("KVSERVE_TEST_PREFORK", "1") != "0")
    zygote = _the_zygote() if forkable else None
    if zygote is not None and zygote.compatible(env):
        reply = zygote.request({"op": "spawn", "argv": list(argv[3:]), "env": dict(env),
                                "log": str(log_path), "cwd": os.getcwd()})
        return ForkedProcess(zygote, reply["pid"], argv)
    with log_path.open("wb") as log:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(env))


# ---- the zygote's side (this file run as a script) ----

def _exit_code(value: object) -> int:
    """Python's exit status for `sys.exit(value)`."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _run_worker(argv: list[str], env: dict[str, str], log: str, cwd: str,
                channels: Sequence[int]) -> None:
    """In the forked child: become `python -m kvserve.cli <argv>` and never return."""
    code = 1
    try:
        for fd in channels:
            os.close(fd)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace",  # noqa: SIM115
                          closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh process's handlers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        import random
        random.seed()  # a fresh process's own seed, not the zygote's state
        from kvserve import cli
        sys.argv = [cli.__file__, *argv]
        try:
            code = _exit_code(cli.main(argv))
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:  # as CPython: the traceback, then death by SIGINT
            import traceback
            traceback.print_exc()
            code = -signal.SIGINT
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit
        atexit._run_exitfuncs()
    except BaseException:  # the worker's own failure: reported in its log
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed log: nothing left to say
                stream.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _zygote_main() -> None:
    """Import what `kvserve serve` imports, then fork workers on request until stdin closes."""
    requests: IO[str] = os.fdopen(os.dup(0), "r")
    replies: IO[str] = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print in an import must not corrupt the replies
    os.close(null)
    # numpy's OpenBLAS starts its thread pool at import; one thread keeps the zygote forkable
    # (a forked worker's numpy BLAS then runs on one thread; the engine's math is torch's).
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for module in _PREIMPORTED:
        importlib.import_module(module)
    # fork() copies only the calling thread: any other would be missing in every worker.
    single = threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    codes: dict[int, int] = {}
    children: set[int] = set()
    channels = (requests.fileno(), replies.fileno())
    for line in requests:
        message = json.loads(line)
        op = message["op"]
        reply: dict[str, Any]
        if op == "hello":
            reply = {"ok": single}
        elif op == "spawn":
            pid = os.fork()
            if pid == 0:
                _run_worker(message["argv"], message["env"], message["log"], message["cwd"],
                            channels)
            children.add(pid)
            reply = {"pid": pid}
        else:  # poll
            pid = message["pid"]
            if pid in children and pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            reply = {"code": codes.get(pid)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    for pid in children - set(codes):  # the test process is gone: so are its workers
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


if __name__ == "__main__":
    _zygote_main()
