"""Runtime fixtures: tiny random Llama and Qwen2 checkpoints and a greedy transformers oracle."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from kvserve.engine import SamplingParams
from kvserve.model import write_random_checkpoint
from kvserve.runtime import EngineArgs, LLMEngine
from tests.model.arch_configs import ARCH_CONFIGS

PARITY_ARCHS = ["llama_gqa", "qwen2_bias_tied"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-ckpt")
    return {name: write_random_checkpoint(root / name, ARCH_CONFIGS[name], seed=11 + i)
            for i, name in enumerate(PARITY_ARCHS)}


@cache
def _hf_model(path: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Never stop at EOS, and never suppress it either (as min_new_tokens would): like ignore_eos.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, exactly `max_tokens` long (EOS ignored)."""
    model = _hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_engine(path: Path, **overrides) -> LLMEngine:
    args = dict(model=str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=256,
                max_num_seqs=16, num_threads=1, audit_interval_steps=1,
                idle_audit_interval_s=0)
    args.update(overrides)
    return LLMEngine.from_args(EngineArgs(**args))


def random_prompt(length: int, seed: int, vocab: int = 300) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=gen).tolist()


def run_to_completion(engine: LLMEngine, max_steps: int = 5000) -> dict[str, object]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    raise AssertionError("engine did not drain")


def generate(engine: LLMEngine, prompts: dict[str, list[int]],
             params: SamplingParams) -> dict[str, list[int]]:
    """Every prompt's first sample's token ids, the engine run until it drains."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = run_to_completion(engine)
    return {rid: done[rid].outputs[0].token_ids for rid in prompts}  # type: ignore[attr-defined]


def assert_no_blocks_held(engine: LLMEngine) -> None:
    stats = engine.kv_cache.stats()
    assert stats.num_held_blocks == 0 and stats.num_live_requests == 0
    report = engine.kv_cache.check_idle()
    assert report.ok, report.describe()
    assert engine.last_audit is None or engine.last_audit.ok, engine.last_audit.describe()
