"""The tokenizer built from GGUF metadata encodes and decodes as transformers' GGUF tokenizer,
renders the file's chat template, and names what it cannot build."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from kvserve.model import ModelLoadError, Tokenizer
from kvserve.model.gguf.tokenizer import merges_from_scores

from .conftest import GGUFFactory
from .gguf_files import SPM_CHAT_TEMPLATE, gpt2_vocabulary, llama_vocabulary

transformers = pytest.importorskip("transformers")
TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\n\nand  newlines  ",
    "Unicode: caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f916 "
    "\u00fcn\u00efc\u00f6d\u00e9 e\u0301",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "It's 7 o'clock; pi is 3.14 (roughly). 1,000,000!",
    "don't WON'T I'll we've",
    "x" * 40,
    "<s>hi</s> <unk> <think>reason</think><|endoftext|>",
    "",
    " ",
    "\n",
    "a  b   c    d",
    "def f(x):\n\treturn x**2  # square",
    "\u03a9\u2248\u00e7\u221a\u222b \U0001f1eb\U0001f1f7 \u00bd",
]
MESSAGES = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "What is 2+2?"}]
CASES = {  # name -> (vocabulary, write_gguf keyword arguments)
    "gpt2_smollm": (lambda: gpt2_vocabulary("smollm"), {}),
    "gpt2_default": (lambda: gpt2_vocabulary("gpt2"), {}),
    "llama_bpe_with_bos": (lambda: gpt2_vocabulary("llama-bpe"), {"add_bos": True}),
    "qwen2": (lambda: gpt2_vocabulary("qwen2"), {}),
    "sentencepiece": (llama_vocabulary, {"chat_template": SPM_CHAT_TEMPLATE}),
}
_MULTI_DIGIT = re.compile(r"\d\d")


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, make_gguf: GGUFFactory) -> tuple[str, Tokenizer, Any]:
    vocab_factory, kwargs = CASES[request.param]
    path = make_gguf(T.Q8_0, vocab=vocab_factory(), write_kwargs=kwargs)
    ours = Tokenizer.from_pretrained(path.parent)  # the directory's one .gguf
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return request.param, ours, ref


def test_encodes_and_decodes_as_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    name, ours, ref = pair
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        if name == "gpt2_smollm" and _MULTI_DIGIT.search(text):
            continue  # transformers ignores the "smollm" split (next test)
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids, skip_special_tokens=False) == ref.decode(
                ids, skip_special_tokens=False)
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_chat_template_and_special_tokens_come_from_the_file(
        pair: tuple[str, Tokenizer, Any]) -> None:
    name, ours, ref = pair
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == ref.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=True)
    assert ours.bos_token == ref.bos_token and ours.eos_token == ref.eos_token
    if name == "sentencepiece":
        assert rendered.startswith("<s>[INST] Hi there [/INST]Hello! How can I help?</s>")
        assert ours.encode("hi")[0] == ours.token_to_id("<s>")  # add_bos unstated: added
    elif name == "llama_bpe_with_bos":
        assert ours.encode("hi")[0] == ours.token_to_id("<|endoftext|>")
    else:
        assert ours.encode_chat(MESSAGES)[0] == ours.token_to_id("<|im_start|>")
        assert ours.encode("hi")[0] != ours.token_to_id("<|endoftext|>")


def test_smollm_splits_every_digit_as_llama_cpp_does(make_gguf: GGUFFactory) -> None:
    """tokenizer.ggml.pre = smollm: digits one by one (llama.cpp and SmolLM's own tokenizer),
    even where this fixture's vocabulary holds merged digits; "gpt2" keeps them merged."""
    smollm = Tokenizer.from_pretrained(make_gguf(vocab=gpt2_vocabulary("smollm")))
    plain = Tokenizer.from_pretrained(make_gguf(vocab=gpt2_vocabulary("gpt2")))
    text = "12345 and 3.14"
    digits = [smollm.id_to_token(i) for i in smollm.encode(text)]
    assert digits[:6] == ["1", "2", "3", "4", "5", "\u0120and"]
    assert len(plain.encode(text)) < len(smollm.encode(text))
    assert smollm.decode(smollm.encode(text)) == text


def test_unknown_pre_tokenizer_is_refused_with_the_way_out(tmp_path: Path,
                                                           make_gguf: GGUFFactory) -> None:
    path = make_gguf(vocab=gpt2_vocabulary("some-new-model"))
    with pytest.raises(ModelLoadError, match=r"'some-new-model'.*smollm.*--tokenizer DIR"):
        Tokenizer.from_pretrained(path)


def test_merges_from_scores_prefer_the_best_score_then_the_longer_left_piece() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -0.5, -2.0]
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"),
                                                  ("a", "bc")]
