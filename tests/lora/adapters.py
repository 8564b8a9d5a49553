"""Random LoRA adapters written by PEFT itself, and transformers + PEFT greedy references."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@functools.lru_cache(maxsize=1)
def _loaded(base: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _base_model(base: Path) -> torch.nn.Module:
    """A private copy of the checkpoint at `base` (PEFT changes the model it wraps in place);
    the last base read is kept, so a test's many references load it once."""
    return copy.deepcopy(_loaded(str(base)))


def write_peft_adapter(base: Path, out: Path, *, rank: int, seed: int, alpha: float = 16.0,
                       targets: list[str] | None = None, rslora: bool = False,
                       scale: float = 0.2) -> Path:
    """A PEFT LoRA adapter for the checkpoint at `base`, saved with `save_pretrained` to `out`.
    PEFT initialises B to zero (a no-op adapter); here A and B are random, so every targeted
    module changes the output."""
    peft = pytest.importorskip("peft")
    model = _base_model(base)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                             lora_dropout=0.1, use_rslora=rslora, bias="none")
    peft_model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], max_tokens: int, *,
                merged: bool) -> list[int]:
    """transformers + PEFT's greedy continuation (EOS ignored): the adapter applied unmerged
    (PEFT's LoRA layers) or merged into the base weights (`merge_and_unload`)."""
    peft = pytest.importorskip("peft")
    model = _base_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()
