"""The server-path bench's offline side: the engine driven by `LLMEngine.step()`, in a process
of its own.

Why its own process: on a VM, two identical engines differ by 5-12% in decode speed with where
their weights landed in memory (two built in one process: the first is the slower, every time;
docs/benchmarks.md). A server is a fresh process with one engine, so the offline side is one
too, started beside each launched server, and the bench compares many such pairs rather than
one engine against one server. The child (`server-path --offline-worker`) builds the engine,
prints "ready", then for each JSON request line on stdin (`{"repeat": r, "instance": i,
"prompts": [...]}`) runs the prompts one at a time and prints the repeat's sample as one JSON
line; it exits at the end of its stdin.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.server_path_readings import Reading, Sample, make_sample, self_reading

KV_CACHE_BYTES = 256 << 20  # both sides: enough for one request, small beside the weights
MAX_MODEL_LEN = 4096
WARMUP_PROMPT = "a warm-up prompt " * 8


def quantization(model: Path) -> str | None:
    """A GGUF file runs with its blocks kept packed (`--quantization gguf`), as users serve it."""
    return "gguf" if model.suffix == ".gguf" else None


class OfflineEngine:
    """The offline engine in this process: each prompt through LLMEngine.step() alone."""

    def __init__(self, model_dir: Path, threads: int, output_len: int, dtype: str) -> None:
        from kvserve.engine import SamplingParams
        from kvserve.runtime import EngineArgs, LLMEngine

        self.engine = LLMEngine.from_args(EngineArgs(
            model=str(model_dir), num_threads=threads, kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN, dtype=dtype, quantization=quantization(model_dir)))
        self.params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        self._one("warmup", WARMUP_PROMPT)

    def run(self, instance: int, repeat: int, prompts: Sequence[str]) -> Sample:
        return make_sample("offline", repeat, [self._one(f"r{repeat}-{i}", prompt)
                                               for i, prompt in enumerate(prompts)],
                           instance=instance)

    def _one(self, request_id: str, prompt: str) -> tuple[Reading, int]:
        """(readings from the first token to the last, tokens after the first)."""
        self.engine.add_request(request_id, prompt, self.params)
        first: Reading | None = None
        num_tokens = 0
        while self.engine.has_unfinished:
            outputs = self.engine.step()
            produced = sum(len(o.outputs[0].token_ids) for o in outputs
                           if o.request_id == request_id)
            if produced and first is None:
                first, num_tokens = self_reading(), produced
            elif produced:
                num_tokens = produced
        assert first is not None, "the request produced no token"
        return self_reading() - first, num_tokens - 1


def worker_main(model_dir: Path, threads: int, output_len: int, dtype: str) -> int:
    """The child's loop (see the module docstring)."""
    engine = OfflineEngine(model_dir, threads, output_len, dtype)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        sample = engine.run(job["instance"], job["repeat"], job["prompts"])
        print(json.dumps(sample.row()), flush=True)
    return 0


class OfflineSide:
    """A child process running `worker_main`, one repeat per `run`."""

    name = "offline"

    def __init__(self, model_dir: Path, threads: int, output_len: int, dtype: str,
                 instance: int) -> None:
        self.instance = instance
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", "server-path", "--offline-worker",
             "--model", str(model_dir), "--threads", str(threads),
             "--output-len", str(output_len), "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect_line("ready")

    def run(self, repeat: int, prompts: Sequence[str]) -> Sample:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"instance": self.instance, "repeat": repeat,
                                          "prompts": list(prompts)}) + "\n")
        self.proc.stdin.flush()
        return Sample.from_row(json.loads(self._expect_line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _expect_line(self, wanted: str | None = None) -> str:
        """The next protocol line ("ready", or a sample's JSON); other lines the engine's build
        printed go on to stderr."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.strip()
            if line == wanted or (wanted is None and line.startswith("{")):
                return line
            print(line, file=sys.stderr)
        self.close()
        raise RuntimeError(f"the offline worker (pid {self.proc.pid}) ended (exit code "
                           f"{self.proc.returncode}) before {wanted or 'a sample'}: see its "
                           "stderr above")
