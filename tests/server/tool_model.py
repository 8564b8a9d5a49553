"""A tiny Llama checkpoint rigged to answer every chat with one Hermes-style tool call.

Its attention and MLP outputs are zero, so the residual stream is the current token's embedding
and the model is a bigram table: `lm_head` maps each token of a chain to the next one. The chain
starts at the chat template's last prompt token and writes, through ordinary added tokens,
`Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`, then
`<|im_end|>`. The server runs its real forward pass, sampler, detokenizer and tool parser on it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

from kvserve.model import Tokenizer, write_random_checkpoint
from kvserve.model.demo_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    SPECIAL_TOKENS,
    build_tokenizer,
)
from tests.model.arch_configs import base_config

BASE_VOCAB = 300
CHAIN_TEXT = ["Checking. ", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "',
              "Paris", '"}}', "</tool_call>"]
EXPECTED_CONTENT = "Checking. "
EXPECTED_CALL = ("get_weather", {"city": "Paris"})
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def write_tool_call_checkpoint(path: Path) -> Path:
    vocab = BASE_VOCAB + len(CHAIN_TEXT)
    write_random_checkpoint(path, base_config(vocab_size=vocab, bos_token_id=0,
                                              eos_token_id=[1, 3], max_position_embeddings=1024),
                            seed=3,
                            write_tokenizer=False)
    tokenizer = build_tokenizer(BASE_VOCAB)
    assert tokenizer.get_vocab_size() == BASE_VOCAB
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAIN_TEXT])
    tokenizer.save(str(path / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }, indent=2), encoding="utf-8")

    loaded = Tokenizer.from_pretrained(path)
    prompt = loaded.encode_chat(MESSAGES, tools=TOOLS)
    chain = [prompt[-1]] + [BASE_VOCAB + i for i in range(len(CHAIN_TEXT))] + \
        [loaded.token_to_id(IM_END)]
    assert len(set(chain)) == len(chain), chain
    weights = load_file(str(path / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones(hidden)
    lm_head = torch.zeros_like(weights["lm_head.weight"])  # [vocab, hidden]
    embed = weights["model.embed_tokens.weight"]
    for k, (token, successor) in enumerate(itertools.pairwise(chain)):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(k), hidden).float()
        lm_head[successor, k] = 5.0
    weights["lm_head.weight"] = lm_head
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
