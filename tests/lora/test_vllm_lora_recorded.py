"""kvserve's greedy tokens with LoRA adapters equal vLLM's CPU build's, recorded once
(tests/data/vllm_lora/record.py): two adapters and the base model in one batch.

The recording shows a vLLM 0.32 CPU bug kvserve does not share: in the mixed batch vLLM's
base-model row came out with the last adapter applied (its tokens are that adapter's greedy
tokens for the prompt, as transformers + PEFT compute them); run alone, vLLM's base row is
right. kvserve's base row equals vLLM's alone run, in the mixed batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
DATA = Path(__file__).parents[1] / "data" / "vllm_lora"


def test_kvserve_matches_vllms_recorded_lora_tokens(tmp_path: Path) -> None:
    sys.path.insert(0, str(DATA))
    try:
        from record import build  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(DATA))
    recorded = json.loads((DATA / "recorded.json").read_text())
    setup = recorded["setup"]
    # Same files as vLLM ran, or the comparison means nothing (re-record after changing them).
    assert build(tmp_path) == recorded["digests"]
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_loras=len(setup["ranks"]),
              max_lora_rank=max(setup["ranks"]), num_threads=1)
    loras = [LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}"))
             for i in range(len(setup["ranks"]))]
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]],
                        SamplingParams(temperature=0, max_tokens=setup["max_tokens"],
                                       ignore_eos=True),
                        use_tqdm=False, lora_request=[*loras, None])
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[:-1] == recorded["tokens"][:-1]  # every adapter row, as vLLM
    assert tokens[-1] == recorded["base_alone"]  # the base row, as vLLM computes it alone
    assert recorded["tokens"][-1] != recorded["base_alone"]  # vLLM's mixed base row (the bug)
    (wrong,) = llm.generate([{"prompt_token_ids": setup["prompts"][-1]}],
                            SamplingParams(temperature=0, max_tokens=setup["max_tokens"],
                                           ignore_eos=True),
                            use_tqdm=False, lora_request=loras[-1])
    assert wrong.outputs[0].token_ids == recorded["tokens"][-1]  # = the last adapter's tokens
