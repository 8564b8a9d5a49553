"""Greedy outputs with LoRA adapters equal transformers + PEFT's, merged and unmerged: four
adapters (ranks 8 and 64) and the base model in ONE batch, through the whole offline engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.model import write_random_checkpoint
from tests.lora.adapters import peft_greedy, write_peft_adapter
from tests.model.arch_configs import ARCH_CONFIGS
from tests.runtime.conftest import random_prompt

pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# (rank, targets, rslora): every projection kind, partial q/k/v and gate/up coverage, rsLoRA.
ADAPTERS = [(8, None, False), (64, ["q_proj", "v_proj", "down_proj"], False),
            (8, ["k_proj", "o_proj", "up_proj"], True), (64, None, True)]


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_bias_tied"])
def setup(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("lora-" + request.param)
    base = write_random_checkpoint(root / "base", ARCH_CONFIGS[request.param], seed=5)
    adapters = [write_peft_adapter(base, root / f"a{i}", rank=r, seed=100 + i, targets=t,
                                   rslora=rs)
                for i, (r, t, rs) in enumerate(ADAPTERS)]
    return base, adapters


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "dense"])
def test_four_adapters_and_the_base_in_one_batch_match_peft(setup, onednn: bool) -> None:
    base, adapters = setup
    prompts = [random_prompt(7 + 3 * i, seed=i) for i in range(5)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] + [None]
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=64, block_size=4,
              num_kv_blocks=128, num_threads=1, onednn_linear=onednn, audit_interval_steps=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    assert llm.engine.runner.lora is not None
    assert llm.engine.core.scheduler.num_steps == GREEDY.max_tokens  # all five in every step
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        adapter = None if lora is None else Path(lora.lora_path)
        unmerged = peft_greedy(base, adapter, prompt, GREEDY.max_tokens, merged=False)
        merged = peft_greedy(base, adapter, prompt, GREEDY.max_tokens, merged=True)
        assert out.outputs[0].token_ids == unmerged == merged, lora


def test_adapters_change_the_output(setup) -> None:
    """The parity above means something: each adapter moves the logits well beyond rounding."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, adapters = setup
    ids = torch.tensor([random_prompt(11, seed=3)])
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(ids).logits
        for adapter in adapters:
            tuned = peft.PeftModel.from_pretrained(model, adapter).eval()
            assert (tuned(ids).logits - plain).abs().max() > 0.05
            model = tuned.unload()
