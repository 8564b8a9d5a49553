"""Tokenizer: byte-level round trips, special tokens, and chat templates rendered as HF does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.model import ChatTemplateError, ModelLoadError, Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a <block> & why?"},
    {"role": "assistant", "content": "A page of KV."},
    {"role": "user", "content": "Thanks — 🙂"},
]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("text", ["", "the cache blocks", "  leading spaces\n\ttabs",
                                  "naïve café — 東京 🙂", "<s> literal </s> specials"])
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    ids = tokenizer.encode("the cache")
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == tokenizer.encode("the cache", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the cache"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>the cache"
    assert tokenizer.token_to_id("<|im_end|>") == 3
    assert tokenizer.id_to_token(3) == "<|im_end|>"
    assert tokenizer.vocab_size <= 300  # never more tokens than the model has rows


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES[:2])
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is a <block> & why?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=False) \
        .endswith("assistant\n")
    ids = tokenizer.encode_chat(MESSAGES[:2])
    assert ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, none added on top
    assert ids[:2] == [0, tokenizer.token_to_id("<|im_start|>")]


def test_tools_use_a_non_escaping_tojson(tokenizer: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "a<b & c"}}]
    text = tokenizer.apply_chat_template(MESSAGES[1:2], tools=tools)
    assert '"description": "a<b & c"' in text
    assert text.startswith("<s><|im_start|>system\nYou can call these tools: [{")


def test_matches_transformers_apply_chat_template(llama_dir: Path, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<int>"}}}]
    for kwargs in ({}, {"add_generation_prompt": False}, {"tools": tools}):
        ours = tokenizer.apply_chat_template(MESSAGES, **kwargs)
        theirs = hf.apply_chat_template(MESSAGES, tokenize=False,
                                        add_generation_prompt=kwargs.get(
                                            "add_generation_prompt", True),
                                        tools=kwargs.get("tools"))
        assert ours == theirs
    assert tokenizer.encode("naïve café 🙂") == hf("naïve café 🙂")["input_ids"]


def write_tokenizer_dir(src: Path, dst: Path, **config_changes: object) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_template_variants(llama_dir: Path, tmp_path: Path) -> None:
    named = write_tokenizer_dir(llama_dir, tmp_path / "named", chat_template=[
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ], bos_token={"content": "<s>", "__type": "AddedToken"})
    tok = Tokenizer.from_pretrained(named)
    assert tok.apply_chat_template(MESSAGES) == "D4"
    assert tok.apply_chat_template(MESSAGES, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.bos_token_id == 0
    jinja = write_tokenizer_dir(llama_dir, tmp_path / "jinja", chat_template=None)
    (jinja / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained(jinja).apply_chat_template(MESSAGES) == "</s>Be brief."


def test_template_errors(llama_dir: Path, tmp_path: Path) -> None:
    strict = write_tokenizer_dir(llama_dir, tmp_path / "strict", chat_template=(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}ok"))
    tok = Tokenizer.from_pretrained(strict)
    with pytest.raises(ChatTemplateError, match=r"must start with a user turn"):
        tok.apply_chat_template(MESSAGES)
    assert tok.apply_chat_template(MESSAGES[1:]) == "ok"
    bare = write_tokenizer_dir(llama_dir, tmp_path / "bare", chat_template=None)
    with pytest.raises(ChatTemplateError, match=r"no chat template"):
        Tokenizer.from_pretrained(bare).apply_chat_template(MESSAGES)
    sandboxed = write_tokenizer_dir(llama_dir, tmp_path / "sandbox",
                                    chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_pretrained(sandboxed).apply_chat_template(MESSAGES)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: file not found"):
        Tokenizer.from_pretrained(tmp_path)
