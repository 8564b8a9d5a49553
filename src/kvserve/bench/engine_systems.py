"""The in-process systems of `kvserve bench engine`: kvserve's LLMEngine and transformers' generate.

Each runner loads the model once (untimed), then per workload: one untimed warm-up on different
tokens, then the timed batch, `repeats` times from a cold prefix cache, keeping the run with the
best output tokens/s (other load on the machine only ever slows a run down).
Timed: from just before the first request is submitted until the last request's last token is
returned (submission, scheduling, forward passes, sampling and detokenization included; model
load, KV allocation and warm-up excluded). TTFT of a request: from its submission to the moment
its first output token is visible to the caller.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvserve.bench.engine_workloads import Workload

KVSERVE = "kvserve"
HF = "hf"
VLLM = "vllm"
LLAMACPP = "llamacpp"
PRECISIONS = ("float32", "bfloat16", "q4_0", "q4_1", "q8_0", "w8a8")  # kvserve's --precision


def kvserve_system(precision: str) -> str:
    """The system name of kvserve in `precision`: plain "kvserve" for float32."""
    return KVSERVE if precision == "float32" else f"{KVSERVE}-{precision}"


@dataclass(slots=True)
class RunResult:
    """One system on one workload: raw measurements (summaries live in engine_report).

    `ttft_s[i]` and `output_token_ids[i]` belong to `workload.prompts[i]`. `seconds` is the timed
    wall time; `num_output_tokens` counts every generated token. A skipped run has `skipped` set
    (the reason) and empty measurements. `peak_rss_mib` is the peak resident memory of the
    process(es) that ran it, as measured where it ran (None where it could not be read).
    """

    system: str
    seconds: float = 0.0
    num_output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    peak_rss_mib: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return cls(system=data["system"], seconds=float(data["seconds"]),
                   num_output_tokens=int(data["num_output_tokens"]),
                   ttft_s=[float(t) for t in data["ttft_s"]],
                   output_token_ids=[list(map(int, o)) for o in data["output_token_ids"]],
                   info=dict(data.get("info", {})),
                   peak_rss_mib=(None if data.get("peak_rss_mib") is None
                                 else float(data["peak_rss_mib"])))


def best_of(runs: Sequence[RunResult]) -> RunResult:
    """The run with the highest output tokens/s; `info["seconds_all"]` lists every repeat."""
    best = max(runs, key=lambda r: r.num_output_tokens / r.seconds)
    best.info["seconds_all"] = [r.seconds for r in runs]
    return best


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run the block with `num_threads` torch intra-op threads, restoring the old count."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class KVServeRunner:
    """kvserve's LLMEngine, stepped by hand: add every request, then `step()` until drained."""

    def __init__(self, model_dir: str, kv_cache_bytes: int, num_threads: int,
                 max_model_len: int | None = None, precision: str = "float32",
                 system: str = KVSERVE) -> None:
        from kvserve.runtime import EngineArgs, LLMEngine

        quantized = precision in PRECISIONS[2:]
        dtype = "bfloat16" if precision == "w8a8" else "float32" if quantized else precision
        self.system = system
        self.args = EngineArgs(model=model_dir, dtype=dtype,
                               quantization=precision if quantized else None,
                               enable_prefix_caching=True,
                               kv_cache_memory_bytes=kv_cache_bytes, num_threads=num_threads,
                               max_model_len=max_model_len)
        self.engine = LLMEngine.from_args(self.args)
        self._next_id = 0

    def info(self) -> dict[str, Any]:
        a = self.args
        ran = self.engine.runner.kv_caches[0].key_cache.dtype  # the model's (no --kv-cache-dtype)
        return {"dtype": a.dtype, "ran_dtype": str(ran).removeprefix("torch."),
                "quantization": a.quantization, "block_size": a.block_size,
                "max_num_seqs": a.max_num_seqs,
                "max_num_batched_tokens": a.max_num_batched_tokens,
                "num_kv_blocks": self.engine.kv_cache.stats().num_blocks}

    def _generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunResult:
        # Invariant: submission and stepping happen on this thread, so a request's first token
        # is visible exactly when the step() that produced it returns.
        from kvserve.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"b{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        index = {rid: i for i, rid in enumerate(ids)}
        submitted = [0.0] * len(prompts)
        first = [0.0] * len(prompts)
        tokens: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        start = time.perf_counter()
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            submitted[i] = time.perf_counter()
            self.engine.add_request(rid, list(prompt), params)
        while self.engine.has_unfinished:
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                i = index[out.request_id]
                new = out.outputs[0].new_token_ids
                if new and not tokens[i]:
                    first[i] = now
                tokens[i].extend(new)
                cached[i] = out.num_cached_tokens
        seconds = time.perf_counter() - start
        return RunResult(self.system, seconds, sum(len(t) for t in tokens),
                         [f - s for f, s in zip(first, submitted, strict=True)], tokens,
                         {"cached_prompt_tokens": sum(cached)})

    def run(self, workload: Workload, repeats: int = 1) -> RunResult:
        self._generate(workload.warmup_prompts, workload.warmup_max_tokens)
        runs = []
        for _ in range(repeats):
            if not self.engine.kv_cache.reset_prefix_cache():
                raise RuntimeError("kvserve could not reset its prefix cache (blocks still held)")
            runs.append(self._generate(workload.prompts, workload.max_tokens))
        result = best_of(runs)
        result.info = self.info() | result.info
        return result

    def close(self) -> None:
        del self.engine
        gc.collect()


class HFRunner:
    """transformers' `generate` on the whole batch at once: greedy, left padding, EOS ignored.

    TTFT: every request's first token is taken to appear at the first logits-processor call
    (right after the batched prefill forward), measured from the start of the `generate` call.
    """

    def __init__(self, model_dir: str, num_threads: int) -> None:
        import torch
        import transformers

        self.torch = torch
        self.num_threads = num_threads
        transformers.utils.logging.disable_progress_bar()
        with torch_threads(num_threads):
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32).eval()
        # Never stop at EOS, and never suppress it (as min_new_tokens would): like ignore_eos.
        self.model.generation_config.eos_token_id = None
        self.pad_token_id = 0
        self.version = transformers.__version__

    def _generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunResult:
        import transformers

        torch = self.torch
        first: list[float] = []

        def mark_first_token(input_ids: Any, scores: Any) -> Any:
            if not first:
                first.append(time.perf_counter())
            return scores

        start = time.perf_counter()
        width = max(len(p) for p in prompts)
        rows = [[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor(rows), attention_mask=torch.tensor(mask), do_sample=False,
                max_new_tokens=max_tokens, pad_token_id=self.pad_token_id,
                logits_processor=transformers.LogitsProcessorList([mark_first_token]))
        seconds = time.perf_counter() - start
        tokens = out[:, width:].tolist()
        ttft = first[0] - start if first else seconds
        return RunResult(HF, seconds, sum(len(t) for t in tokens), [ttft] * len(prompts), tokens)

    def run(self, workload: Workload, repeats: int = 1) -> RunResult:
        with torch_threads(self.num_threads):
            self._generate(workload.warmup_prompts, workload.warmup_max_tokens)
            result = best_of([self._generate(workload.prompts, workload.max_tokens)
                              for _ in range(repeats)])
        result.info |= {"transformers_version": self.version,
                        "attn_implementation": self.model.config._attn_implementation}
        return result

    def close(self) -> None:
        del self.model
        gc.collect()
