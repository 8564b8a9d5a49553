"""The vLLM side of `python -m benchmarks lora --peer vllm`: the same cases on vLLM's CPU build.

kvserve's venv cannot import vLLM, so the cases go as token ids and adapter paths in a JSON spec
to benchmarks/peers/vllm_lora_driver.py, run by vLLM's interpreter (docs/peers.md): one process
with LoRA off for the cases that have it off, one with LoRA on for the others (vLLM, like
kvserve, fixes `enable_lora` when the engine starts). This module imports no torch.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's LoRAConfig accepts only these max_lora_rank values (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the benchmark: whether the engine starts with LoRA on, and each prompt's
    adapter (an index into the adapter list) or None for the base model. The same Case runs
    on kvserve and on vLLM."""

    name: str
    enable_lora: bool
    adapter_idx: list[int | None]


@dataclass(frozen=True, slots=True)
class Workload:
    """What every case runs: prompts as token ids (timed), warm-up prompts (other token ids,
    untimed), the adapters as (name, id, PEFT directory), greedy `max_tokens` per request."""

    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    adapters: list[tuple[str, int, str]]
    rank: int
    max_tokens: int
    warmup_max_tokens: int = 2

    def warmup_adapter_idx(self, case: Case) -> list[int | None]:
        """The warm-up uses each adapter the case uses, round-robin like the timed prompts."""
        used = [i for i in dict.fromkeys(case.adapter_idx) if i is not None]
        if not used:
            return [None] * len(self.warmup_prompts)
        return [used[k % len(used)] for k in range(len(self.warmup_prompts))]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"--rank {rank} is above vLLM's largest max_lora_rank "
                         f"({VLLM_LORA_RANKS[-1]})")
    return fits[0]


def driver_spec(model: Path, workload: Workload, cases: list[Case], num_threads: int,
                kv_cache_bytes: int) -> dict[str, Any]:
    """The driver's spec for cases that share one engine (all LoRA on, or all off)."""
    assert len({c.enable_lora for c in cases}) == 1, "one engine: LoRA on for all or for none"
    num_adapters = len(workload.adapters)
    lora = ({"max_loras": num_adapters, "max_lora_rank": vllm_max_lora_rank(workload.rank),
             "max_cpu_loras": num_adapters} if cases[0].enable_lora else None)
    longest = max(map(len, workload.prompts + workload.warmup_prompts))
    return {
        "model": str(model), "kv_cache_bytes": kv_cache_bytes, "num_threads": num_threads,
        "max_model_len": longest + max(workload.max_tokens, workload.warmup_max_tokens),
        "max_num_seqs": max(len(workload.prompts), len(workload.warmup_prompts)), "lora": lora,
        "adapters": [{"name": n, "id": i, "path": p} for n, i, p in workload.adapters],
        "cases": [{"name": c.name, "prompts": workload.prompts, "adapter_idx": c.adapter_idx,
                   "max_tokens": workload.max_tokens,
                   "warmup_prompts": workload.warmup_prompts,
                   "warmup_adapter_idx": workload.warmup_adapter_idx(c),
                   "warmup_max_tokens": workload.warmup_max_tokens} for c in cases],
    }


def run_vllm(python: Path, driver: Path, spec: dict[str, Any],
             timeout: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the driver on `spec`: one result per case ({"case", "error", "log_tail"} when that
    case or the whole run failed: the error and the end of vLLM's log) and the run's
    info (vLLM's version, load seconds, dtype, thread binding)."""
    from kvserve.bench.engine_peers import run_driver

    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "w", encoding="utf-8") as log:
            code, stdout = run_driver([str(python), str(driver), "--spec", str(spec_path)],
                                      log, timeout)
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip()
    names = [c["name"] for c in spec["cases"]]
    if code is None:
        return [{"case": n, "error": f"vLLM timed out after {timeout:.0f}s"} for n in names], {}
    try:
        payload = json.loads(stdout.strip().splitlines()[-1]) if code == 0 else None
    except (json.JSONDecodeError, IndexError):
        payload = None
    if payload is None:
        last = tail.splitlines()[-1] if tail else "no output"
        error = f"vLLM driver failed (exit {code}): {last}"
        return [{"case": n, "error": error, "log_tail": tail[-1500:]} for n in names], {}
    info = {"vllm_version": payload["vllm_version"],
            "load_seconds": round(payload["load_seconds"], 1), **payload["info"]}
    results = [r | {"log_tail": tail[-1500:]} if "error" in r else r for r in payload["results"]]
    return results, info


def agreement(kvserve_tokens: list[list[int]], vllm_tokens: list[list[int]]) -> dict[str, str]:
    """How much of the same work the two engines did: prompts whose greedy tokens are equal,
    and output tokens equal before each prompt's first difference, as "equal/total"."""
    assert len(kvserve_tokens) == len(vllm_tokens), "one token list per prompt on both sides"
    equal = sum(a == b for a, b in zip(kvserve_tokens, vllm_tokens, strict=True))
    leading = 0
    for a, b in zip(kvserve_tokens, vllm_tokens, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            leading += 1
    total = sum(len(a) for a in kvserve_tokens)
    return {"prompts_equal": f"{equal}/{len(kvserve_tokens)}",
            "leading_tokens_equal": f"{leading}/{total}"}
