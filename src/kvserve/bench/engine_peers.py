"""The out-of-process peers of `kvserve bench engine`: vLLM's CPU engine (once per `--vllm-dtype`)
and llama.cpp on the model's GGUF file, each through its driver in the repository's
benchmarks/peers, run inside the peer's own interpreter (peers_env).

A driver reads a JSON spec (the model, sizes and workloads as token ids) and prints one JSON object
({version keys, "load_seconds", "results": [one per workload]}); every failure here becomes a
skipped run that says why, never an exception.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from kvserve.bench.engine_systems import LLAMACPP, VLLM, RunResult
from kvserve.bench.engine_workloads import Workload
from kvserve.bench.peers_env import llamacpp_python, peer_driver, vllm_python

VLLM_DRIVER = peer_driver("vllm_engine_driver.py")
LLAMACPP_DRIVER = peer_driver("llamacpp_engine_driver.py")
VLLM_DTYPES = ("float32", "bfloat16")


def vllm_system(dtype: str) -> str:
    """vLLM's system name in `dtype`: plain "vllm" for float32 (the name older runs print)."""
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"--vllm-dtype {dtype!r}: choose from {', '.join(VLLM_DTYPES)}")
    return VLLM if dtype == "float32" else f"{VLLM}:{dtype}"


def kv_cache_bytes(args: argparse.Namespace) -> int:
    return int(args.kv_cache_gib * (1 << 30))


def run_vllm(model_dir: Path, workloads: list[Workload], args: argparse.Namespace, err: Console,
             dtype: str = "float32") -> list[RunResult]:
    """One vLLM driver process in `dtype` for every workload of a model."""
    python = vllm_python()
    assert python is not None and VLLM_DRIVER is not None
    spec = {"model": str(model_dir), "dtype": dtype, "max_model_len": args.max_model_len,
            "kv_cache_bytes": kv_cache_bytes(args), "num_threads": args.threads,
            "enforce_eager": args.vllm_eager, "repeats": args.repeats,
            "omp_threads_bind": args.vllm_omp_bind, "workloads": [w.as_dict() for w in workloads]}
    return run_peer(vllm_system(dtype), [str(python), str(VLLM_DRIVER)], spec, len(workloads),
                    args.peer_timeout, err)


def run_llamacpp(gguf: Path, vocab_size: int, workloads: list[Workload],
                 args: argparse.Namespace, err: Console) -> list[RunResult]:
    """One llama.cpp driver process on `gguf` for every workload of a model (one sequence at a
    time: llama-cpp-python's `Llama` holds one)."""
    python = llamacpp_python()
    assert python is not None and LLAMACPP_DRIVER is not None
    spec = {"gguf": str(gguf), "vocab_size": vocab_size, "max_model_len": args.max_model_len,
            "num_threads": args.threads, "repeats": args.repeats,
            "workloads": [w.as_dict() for w in workloads]}
    return run_peer(LLAMACPP, [str(python), str(LLAMACPP_DRIVER)], spec, len(workloads),
                    args.peer_timeout, err)


def run_peer(system: str, driver_cmd: list[str], spec: dict[str, Any], num_workloads: int,
             timeout: float, err: Console) -> list[RunResult]:
    """Run `driver_cmd --spec FILE` on `spec`; one RunResult per workload, labelled `system`.
    The payload's top-level keys but "results" (versions, load seconds) go into each run's info;
    a timeout, a crash or an unreadable payload skips every workload, a failed workload itself."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        log_path = Path(tmp) / "driver.log"
        with open(log_path, "w", encoding="utf-8") as log:
            code, stdout = run_driver([*driver_cmd, "--spec", str(spec_path)], log, timeout)
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip()[-1500:]
    if code is None:
        return [RunResult(system, skipped=f"timed out after {timeout:.0f}s")
                for _ in range(num_workloads)]
    payload = parse_payload(stdout) if code == 0 else None
    if payload is None or len(payload["results"]) != num_workloads:
        err.print(f"[yellow]{system} driver failed ({code}):[/]\n{tail}", soft_wrap=True)
        last = tail.splitlines()[-1] if tail else exit_reason(code)
        return [RunResult(system, skipped=f"driver failed: {last}") for _ in range(num_workloads)]
    shared = {k: v for k, v in payload.items() if k != "results"}
    runs = []
    for item in payload["results"]:
        if "error" in item:
            runs.append(RunResult(system, skipped=f"failed: {item['error']}"))
            continue
        run = RunResult.from_dict(item)
        run.system = system
        run.info |= shared
        runs.append(run)
    return runs


def exit_reason(code: int) -> str:
    """A silent driver's exit in words: the signal that killed it (SIGILL: the peer was built
    for instructions this CPU lacks) or its exit code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"no output, killed by {signal.Signals(-code).name}"
    return f"no output, exit code {code}"


def parse_payload(stdout: str) -> dict[str, Any] | None:
    """The driver's JSON object (its stdout's last line) when it holds a "results" list."""
    try:
        payload = json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return None
    ok = isinstance(payload, dict) and isinstance(payload.get("results"), list)
    return payload if ok else None


def run_driver(cmd: list[str], log: IO[str], timeout: float) -> tuple[int | None, str]:
    """Run a peer driver in its own process group; (exit code or None on timeout, stdout).
    On timeout the whole group goes (vLLM's engine-core process outlives a killed leader)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, ""
    return proc.returncode, stdout
