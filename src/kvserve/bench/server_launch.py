"""Start, health-check and stop the OpenAI-compatible servers that `kvserve bench serve` measures.

Each server runs in its own process group on a free loopback port, its output going to a log
file; `stop()` ends that group only. kvserve and vLLM get the same model directory, served model
name, KV cache budget in bytes, max_model_len, max_num_seqs, max_num_batched_tokens and compute
threads, with prefix caching on, and the dtype and quantization of their LaunchTarget's mode
(float32 by default; launch_target.py); llama.cpp's server, and kvserve in mode gguf, get the
same model as a GGUF file (llama.cpp: with the served name, the threads and the context length).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

import httpx

# The server names live with the modes; imported from here by every launcher.
from kvserve.bench.launch_target import KVSERVE as KVSERVE
from kvserve.bench.launch_target import LLAMACPP as LLAMACPP
from kvserve.bench.launch_target import SERVERS as SERVERS
from kvserve.bench.launch_target import VLLM as VLLM
from kvserve.bench.launch_target import LaunchTarget, precision_args
from kvserve.bench.peers_env import llamacpp_python, missing_peer_message, vllm_python

LOG_TAIL_CHARS = 1500


class LaunchError(Exception):
    """The server could not be started or never became healthy; the message says why."""


T = TypeVar("T")
PORT_CLASH = "Address already in use"


def retry_port_clash(call: Callable[[], T], note: Callable[[str], object]) -> T:
    """`call()`, once more if a process it started lost its port to another process between
    `free_port()` and its bind (`call` must start new processes, which pick new ports); `note`
    is told of the retry."""
    try:
        return call()
    except LaunchError as exc:
        if PORT_CLASH not in str(exc):
            raise
        note(f"port clash ({exc}); once more on new ports")
        return call()


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What every launched server is given (see the module docstring)."""

    model_dir: Path
    served_model_name: str
    kv_cache_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_threads: int
    vllm_eager: bool = False
    cpus: str | None = None  # vLLM's OpenMP binding, e.g. "1" or "0-1" (default: 0..threads-1)
    block_size: int | None = None  # KV block size in tokens (default: the server's)
    extra_args: tuple[str, ...] = ()  # appended to the server's command line as given
    gguf_file: Path | None = None  # the same model as a GGUF file: what llama.cpp's server reads
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment (kvserve and vLLM)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(target: LaunchTarget | str, spec: LaunchSpec, port: int
                   ) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start `target` (a bare name: its default mode);
    LaunchError if the server is absent, the name or mode unknown, or a GGUF file needed and
    `spec.gguf_file` None."""
    target = LaunchTarget(target) if isinstance(target, str) else target
    problem = target.problem()
    if problem is not None:
        raise LaunchError(problem)
    if target.reads_gguf and spec.gguf_file is None:
        raise LaunchError(f"{target.label} reads GGUF files only: pass --gguf FILE (the same "
                          "model as a .gguf)")
    env = dict(os.environ) | dict(spec.env)
    if target.name == LLAMACPP:
        return _llamacpp_command(spec, port), env
    model = spec.gguf_file if target.reads_gguf else spec.model_dir
    common = ["--model", str(model), "--served-model-name", spec.served_model_name,
              "--host", "127.0.0.1", "--port", str(port), *precision_args(target),
              "--max-model-len", str(spec.max_model_len),
              "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
              "--max-num-seqs", str(spec.max_num_seqs),
              "--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.block_size is not None:
        common += ["--block-size", str(spec.block_size)]
    if target.name == KVSERVE:
        return ([sys.executable, "-m", "kvserve.cli", "serve", *common,
                 "--num-threads", str(spec.num_threads), "--drain-timeout", "1",
                 *spec.extra_args], env)
    python = vllm_python()
    if python is None:
        raise LaunchError(missing_peer_message("vLLM", "KVSERVE_VLLM_PYTHON"))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    threads = spec.num_threads
    bind = spec.cpus or ("0" if threads == 1 else f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", *common,
           "--enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log"]
    cmd += list(spec.extra_args)
    return (cmd + ["--enforce-eager"] if spec.vllm_eager else cmd), env


def _llamacpp_command(spec: LaunchSpec, port: int) -> list[str]:
    """llama-cpp-python's server on the GGUF file: it runs the file's quantized weights itself,
    one sequence at a time, with the same threads and context length."""
    python = llamacpp_python()
    if python is None:
        raise LaunchError(missing_peer_message("llama.cpp's server", "KVSERVE_LLAMACPP_PYTHON"))
    assert spec.gguf_file is not None  # server_command checked it
    return [str(python), "-m", "llama_cpp.server", "--model", str(spec.gguf_file),
            "--model_alias", spec.served_model_name, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(spec.num_threads), "--n_threads_batch", str(spec.num_threads),
            "--n_ctx", str(spec.max_model_len), "--verbose", "False"]


class ManagedProcess(ABC):
    """One server-like process on a free loopback port, in its own process group, its output
    going to `log_dir/<name>-<port>.log`. Use as a context manager: `start()` on entry (returns
    once `health_path` answers 200), `stop()` on exit. Subclasses say what to run (`command`)."""

    health_path = "/health"

    def __init__(self, name: str, log_dir: Path, startup_timeout_s: float):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def command(self) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start the process."""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return text.strip()[-LOG_TAIL_CHARS:]

    def start(self) -> None:
        """Start the process and wait for health; LaunchError (process stopped) if it fails."""
        self.launch()
        self.wait_healthy()

    def launch(self) -> None:
        """Start the process without waiting (see `wait_healthy`)."""
        cmd, env = self.command()
        self._started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self) -> None:
        """Wait for a launched process to answer health; LaunchError (process stopped) if not."""
        try:
            self._wait_healthy(self._started)
        except LaunchError:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - self._started

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() - started < self.startup_timeout_s:
                code = self._proc.poll()
                if code is not None:
                    last = self.log_tail().splitlines()[-1:] or ["no output"]
                    raise LaunchError(f"{self.name} exited with code {code} during startup: "
                                      f"{last[0]}")
                try:
                    if client.get(f"{self.url}{self.health_path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise LaunchError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def cpu_seconds(self) -> float | None:
        """User + system CPU the process (all its threads) has used so far; None when it is
        not running or the platform has no /proc."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for failover tests); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left of it after 30 s; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30.0)
        _signal_group(proc.pid, signal.SIGKILL)  # children (vLLM's engine core) outlive the leader
        proc.wait()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LaunchedServer(ManagedProcess):
    """One OpenAI-compatible server started from a LaunchSpec: `target` is a LaunchTarget or
    a bare name in SERVERS (its default mode); `name` is the target's label."""

    def __init__(self, target: LaunchTarget | str, spec: LaunchSpec, log_dir: Path,
                 startup_timeout_s: float):
        self.target = LaunchTarget(target) if isinstance(target, str) else target
        super().__init__(self.target.label, log_dir, startup_timeout_s)
        self.spec = spec
        if self.target.name == LLAMACPP:
            self.health_path = "/v1/models"  # llama-cpp-python's server has no /health

    def command(self) -> tuple[list[str], dict[str, str]]:
        return server_command(self.target, self.spec, self.port)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)  # the group LaunchedServer created, nothing else


@dataclass(frozen=True, slots=True)
class CpuReading:
    """CPU seconds used so far by a run's router processes (together) and by each worker
    process (by pid), read from /proc: what routing costs on the machine the workers share."""

    router_s: float | None
    workers_s: dict[int, float]

    @classmethod
    def of(cls, routers: Sequence[ManagedProcess], workers: Sequence[ManagedProcess]
           ) -> CpuReading:
        readings = [r.cpu_seconds() for r in routers]
        router_s = (sum(x for x in readings if x is not None)
                    if routers and None not in readings else None)
        workers_s: dict[int, float] = {}
        for worker in workers:
            pid, seconds = worker.pid, worker.cpu_seconds()
            if pid is not None and seconds is not None:
                workers_s[pid] = seconds
        return cls(router_s, workers_s)

    def per_request_ms(self, before: CpuReading, num_requests: int) -> dict[str, float]:
        """CPU ms per request since `before`: "router" (absent without router processes) and
        "workers" (absent when a worker restarted in between: its CPU is not all counted)."""
        out: dict[str, float] = {}
        if num_requests < 1:
            return out
        if self.router_s is not None and before.router_s is not None:
            out["router"] = (self.router_s - before.router_s) * 1000.0 / num_requests
        if self.workers_s and self.workers_s.keys() == before.workers_s.keys():
            used = sum(self.workers_s[p] - before.workers_s[p] for p in self.workers_s)
            out["workers"] = used * 1000.0 / num_requests
        return out
