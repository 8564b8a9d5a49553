"""OpenAI response bodies from engine outputs: completions and chat, whole and streamed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve import __version__
from kvserve.engine import TokenLogprob
from kvserve.model import Tokenizer
from kvserve.runtime import CompletionOutput, RequestOutput
from kvserve.server.tool_calls import ToolPlan
from kvserve.server.tool_parsers import ToolCall, ToolStream

SYSTEM_FINGERPRINT = f"kvserve-{__version__}"


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


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
class _Delta:
    """What of one sample a stream has not sent yet."""

    text: str
    logprobs: Sequence[TokenLogprob]
    has_new_tokens: bool
    ended: bool


class _StreamCursor:
    """How much of each sample's cumulative output a stream has sent.

    A streamed `RequestOutput` is the engine's live object: its `new_*` fields may already
    belong to a later step when the server reads them, so deltas are taken from the cumulative
    fields instead. `finish_reason` is read first: the engine sets it after the final text and
    logprobs, so an ended sample's delta is complete.
    """

    def __init__(self) -> None:
        self._sent: dict[Any, tuple[int, int, int]] = {}  # key -> (chars, tokens, logprobs)
        self._ended: set[Any] = set()

    def take(self, key: Any, c: CompletionOutput) -> _Delta:
        reason = c.finish_reason
        text, num_tokens, logprobs = c.text, len(c.token_ids), c.logprobs[:]
        chars, tokens, lps = self._sent.get(key, (0, 0, 0))
        self._sent[key] = (len(text), num_tokens, len(logprobs))
        ended = reason is not None and key not in self._ended
        if ended:
            self._ended.add(key)
        return _Delta(text[chars:], logprobs[lps:], num_tokens > tokens, ended)


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
        self._cursor = _StreamCursor()
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
                })
        return self._head() | {"choices": choices, "usage": usage(outputs),
                               "system_fingerprint": SYSTEM_FINGERPRINT, "service_tier": None}

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
            })
        return self._head() | {"choices": choices} if choices else None

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        return self._head() | {"choices": [], "usage": usage(outputs),
                               "system_fingerprint": SYSTEM_FINGERPRINT}


class ChatFormatter:
    """Bodies for /v1/chat/completions. With a `tools` plan, each choice's text is read into
    content and `tool_calls` (streamed: `delta.tool_calls`), finish_reason "tool_calls"."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, created: int, model: str,
                 want_logprobs: bool, tools: ToolPlan | None = None) -> None:
        self.tokenizer = tokenizer
        self.id = f"chatcmpl-{request_id}"
        self.created = created
        self.model = model
        self.want_logprobs = want_logprobs
        self._role_sent: set[int] = set()
        self._cursor = _StreamCursor()
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}
        self._num_calls: dict[int, int] = {}  # calls sent per choice

    def _finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        reason = finish_reason(c)
        if (called and reason == "stop" and self.tools is not None
                and self.tools.finishes_with_tool_calls):
            return "tool_calls"
        return reason

    def _message(self, c: CompletionOutput) -> tuple[dict[str, Any], bool]:
        if self.tools is None:
            return {"role": "assistant", "content": c.text}, False
        parsed = self.tools.parse(c.text)
        return {"role": "assistant", "content": parsed.content,
                "tool_calls": [call.as_dict() for call in parsed.calls]}, bool(parsed.calls)

    def _tool_delta(self, index: int, text: str, ended: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) of one choice's new text."""
        stream = self._tool_streams.get(index)
        if stream is None:
            assert self.tools is not None
            stream = self._tool_streams[index] = self.tools.stream()
        content, calls = stream.feed(text)
        if ended:
            tail, more = stream.finish()
            content, calls = content + tail, calls + more
        return content, [self._call_delta(index, call) for call in calls]

    def _call_delta(self, index: int, call: ToolCall) -> dict[str, Any]:
        position = self._num_calls.get(index, 0)
        self._num_calls[index] = position + 1
        return {"index": position} | call.as_dict()

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in output.outputs:
            message, called = self._message(c)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": chat_logprobs(self.tokenizer, c.logprobs) if self.want_logprobs
                else None,
                "finish_reason": self._finish_reason(c, called),
            })
        return self._head("chat.completion") | {"choices": choices, "usage": usage([output])}

    def chunk(self, output: RequestOutput) -> dict[str, Any] | None:
        choices = []
        for c in output.outputs:
            delta: dict[str, Any] = {}
            if c.index not in self._role_sent:
                delta["role"] = "assistant"
                self._role_sent.add(c.index)
            new = self._cursor.take(c.index, c)
            logprobs = new.logprobs if self.want_logprobs else ()
            text, calls = new.text, []
            if self.tools is not None:
                text, calls = self._tool_delta(c.index, new.text, new.ended)
            if text or logprobs:  # a token may have logprobs before it has text
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if not delta and not new.ended:
                continue
            if "content" not in delta and "role" in delta:
                delta["content"] = ""
            choices.append({
                "index": c.index, "delta": delta,
                "logprobs": chat_logprobs(self.tokenizer, logprobs) if logprobs else None,
                "finish_reason": self._finish_reason(c, c.index in self._num_calls)
                if new.ended else None,
            })
        return self._head("chat.completion.chunk") | {"choices": choices} if choices else None

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        return self._head("chat.completion.chunk") | {"choices": [], "usage": usage([output])}

