"""OpenAI response bodies of /v1/completions from engine outputs, whole and streamed, and what
chat's bodies share with them (usage, logprobs, the stream cursor).

The bodies carry the fields vLLM 0.32 sends, with vLLM's nulls for what kvserve has no value
for (its connectors' `kv_transfer_params`, `token_ids` unless asked for, ...), so clients and
tools written against vLLM's answers read kvserve's unchanged (tests/data/vllm_responses)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve import __version__
from kvserve.engine import TokenLogprob
from kvserve.model import Tokenizer
from kvserve.runtime import CompletionOutput, RequestOutput

SYSTEM_FINGERPRINT = f"kvserve-{__version__}"


# Fields of vLLM's whole answers that kvserve has no value for: vLLM sends them null.
VLLM_NULLS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
CHOICE_NULLS = {"token_ids": None, "routed_experts": None}


def usage(outputs: Sequence[RequestOutput], whole: bool = True) -> dict[str, Any]:
    """The usage object; `prompt_tokens_details.cached_tokens` counts prefix-cache hits (as
    vLLM's --enable-prompt-tokens-details). A stream's usage chunk, as vLLM's, has no
    `completion_tokens_details`."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    return out | {"completion_tokens_details": None} if whole else out


def finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason.openai_name if completion.finish_reason else None


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_start: int = 0,
    with_token: bool = False,
) -> dict[str, Any]:
    """The legacy completions logprobs object; `with_token`: each top dict also has the token
    itself (vLLM's prompt logprobs: the prompt token is rarely among the top ones)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_start
    for lp in logprobs:
        token = tokenizer.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        alternatives = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in lp.top}
        top.append(({token: lp.logprob} if with_token else {}) | alternatives)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat logprobs object: `content` with one entry per token."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [entry(lp.token_id, lp.logprob)
                        | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def echo_logprobs(tokenizer: Tokenizer, output: RequestOutput) -> dict[str, Any]:
    """The completions logprobs object of a prompt (for `echo`): its first token has none."""
    ids = output.prompt_token_ids
    scored = output.prompt_logprobs or []
    first = tokenizer.decode(ids[:1], skip_special_tokens=False)
    rest = completion_logprobs(tokenizer, [lp for lp in scored[1:] if lp is not None],
                               len(first), with_token=True)
    return {"tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def prompt_logprobs(tokenizer: Tokenizer, output: RequestOutput) -> list[Any] | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt token (None for the first) a map of
    token id -> logprob, rank and text, for the token itself and the top alternatives."""
    if output.prompt_logprobs is None:
        return None

    def entry(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"logprob": logprob, "rank": rank, "decoded_token": text}

    out: list[Any] = []
    for lp in output.prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        found = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}
        for i, (token_id, value) in enumerate(lp.top):
            found.setdefault(str(token_id), entry(value, i + 1, token_id))
        out.append(found)
    return out


def _joined(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects, `tail`'s offsets after `head`'s text."""
    return {key: head[key] + tail[key] for key in head}


def echo_text(tokenizer: Tokenizer, output: RequestOutput) -> str:
    """The prompt as `echo` returns it: the text sent, or the token ids decoded."""
    if output.prompt is not None:
        return output.prompt
    return tokenizer.decode(output.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What of one sample a stream has not sent yet."""

    text: str
    logprobs: Sequence[TokenLogprob]
    has_new_tokens: bool
    ended: bool


class StreamCursor:
    """How much of each sample's cumulative output a stream has sent.

    A streamed `RequestOutput` is the engine's live object: its `new_*` fields may already
    belong to a later step when the server reads them, so deltas are taken from the cumulative
    fields instead. `finish_reason` is read first: the engine sets it after the final text and
    logprobs, so an ended sample's delta is complete.
    """

    def __init__(self) -> None:
        self._sent: dict[Any, tuple[int, int, int]] = {}  # key -> (chars, tokens, logprobs)
        self._ended: set[Any] = set()

    def take(self, key: Any, c: CompletionOutput) -> StreamDelta:
        reason = c.finish_reason
        text, num_tokens, logprobs = c.text, len(c.token_ids), c.logprobs[:]
        chars, tokens, lps = self._sent.get(key, (0, 0, 0))
        self._sent[key] = (len(text), num_tokens, len(logprobs))
        ended = reason is not None and key not in self._ended
        if ended:
            self._ended.add(key)
        return StreamDelta(text[chars:], logprobs[lps:], num_tokens > tokens, ended)

    def has_ended(self, key: Any) -> bool:
        """Whether the sample's last delta has been taken."""
        return key in self._ended


class CompletionFormatter:
    """Bodies for /v1/completions; choice index = prompt index * n + sample index."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, created: int, model: str,
                 n: int, want_logprobs: bool, echo: bool = False,
                 generate: bool = True) -> None:
        self.tokenizer = tokenizer
        self.id = f"cmpl-{request_id}"
        self.created = created
        self.model = model
        self.n = n
        self.want_logprobs = want_logprobs
        self.echo = echo  # each choice starts with its prompt (and the prompt's logprobs)
        self.generate = generate  # False: echo only (max_tokens 0), the sample is not shown
        self._cursor = StreamCursor()
        self._echoed: set[Any] = set()
        self._offsets: dict[Any, int] = {}  # per streamed sample: the next token's text_offset

    def _prompt_chars(self, output: RequestOutput) -> int:
        """Where the echoed prompt's text ends, as its logprobs' offsets count it (the
        prompt's tokens decoded one by one; the text sent, without logprobs)."""
        if not self.want_logprobs:
            return len(echo_text(self.tokenizer, output))
        head = echo_logprobs(self.tokenizer, output)
        return int(head["text_offset"][-1] + len(head["tokens"][-1]))

    def _text_and_logprobs(self, output: RequestOutput, text: str,
                           logprobs: Sequence[TokenLogprob], with_prompt: bool,
                           text_start: int = 0) -> tuple[str, dict[str, Any] | None]:
        """A choice's text and logprobs object; `with_prompt`: the prompt goes first."""
        if not self.generate:
            text, logprobs = "", ()
        lps = None
        if with_prompt:
            prompt = echo_text(self.tokenizer, output)
            if self.want_logprobs:
                head = echo_logprobs(self.tokenizer, output)
                lps = _joined(head, completion_logprobs(self.tokenizer, logprobs,
                                                        self._prompt_chars(output)))
            return prompt + text, lps
        if self.want_logprobs:
            lps = completion_logprobs(self.tokenizer, logprobs, text_start)
        return text, lps

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}

    def whole(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, output in enumerate(outputs):
            for c in output.outputs:
                text, logprobs = self._text_and_logprobs(output, c.text, c.logprobs, self.echo)
                choices.append({
                    "index": p * self.n + c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish_reason(c), "stop_reason": c.stop_reason,
                    "prompt_logprobs": prompt_logprobs(self.tokenizer, output),
                    "prompt_token_ids": None,
                } | CHOICE_NULLS)
        return self._head() | {"choices": choices, "usage": usage(outputs),
                               "system_fingerprint": SYSTEM_FINGERPRINT,
                               "service_tier": None} | VLLM_NULLS

    def chunk(self, prompt_idx: int, output: RequestOutput) -> dict[str, Any] | None:
        choices = []
        for c in output.outputs:
            key = (prompt_idx, c.index)
            delta = self._cursor.take(key, c)
            if not (delta.text or delta.has_new_tokens or delta.ended):
                continue
            with_prompt = self.echo and key not in self._echoed
            self._echoed.add(key)
            text, logprobs = self._text_and_logprobs(output, delta.text, delta.logprobs,
                                                     with_prompt, self._offsets.get(key, 0))
            if logprobs and logprobs["tokens"]:  # offsets run on over the tokens' texts
                self._offsets[key] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if not (text or logprobs or delta.ended):
                continue
            choices.append({
                "index": prompt_idx * self.n + c.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason(c) if delta.ended else None,
                "stop_reason": c.stop_reason if delta.ended else None,
                "prompt_token_ids": None, "token_ids": None,
            })
        return self._head() | {"choices": choices} if choices else None

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        return self._head() | {"choices": [], "usage": usage(outputs, whole=False),
                               "system_fingerprint": SYSTEM_FINGERPRINT}
