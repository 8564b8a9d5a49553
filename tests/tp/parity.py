"""Greedy parity through a live server: the official openai client's tokens and logprobs,
compared with transformers' greedy continuation (which TP=1 matches token for token)."""

from __future__ import annotations

from pathlib import Path

import openai
import torch

from kvserve.model import Tokenizer
from tests.runtime.conftest import _hf_model, hf_greedy


def openai_client(url: str) -> openai.OpenAI:
    """The official client for the server at `url`, without retries."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="dummy", max_retries=0, timeout=120.0)


Tokens = list[tuple[str, float]]  # (token text, logprob) per generated token


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> Tokens:
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                    max_tokens=max_tokens, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == max_tokens
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    return list(zip(logprobs.tokens, logprobs.token_logprobs, strict=True))


def hf_tokens(path: Path, prompt: list[int], max_tokens: int) -> Tokens:
    """transformers' greedy continuation: each token's text and log-probability."""
    model = _hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    assert ids == hf_greedy(path, prompt, max_tokens)
    tokenizer = Tokenizer.from_pretrained(path)
    return [(tokenizer.decode([t], skip_special_tokens=False),
             torch.log_softmax(score[0].float(), -1)[t].item())
            for t, score in zip(ids, out.scores, strict=True)]


def same(got: Tokens, want: Tokens) -> bool:
    return [t for t, _ in got] == [t for t, _ in want] and all(
        abs(a - b) < 1e-3 for (_, a), (_, b) in zip(got, want, strict=True))
