"""OpenAI response bodies of /v1/chat/completions from engine outputs, whole and streamed, in
the fields vLLM 0.32 sends (its nulls included; see kvserve.server.formatting).

A stream opens each choice with a role chunk (`{"role": "assistant", "content": ""}`), sends its
text as it comes, and ends it with `finish_reason` and `stop_reason`; the stream's last chunk
(the usage chunk when asked for) carries `system_fingerprint`. With a tools plan, each choice's
text is read into content and `tool_calls`: streamed, a call's first piece names it and its
arguments follow as they are written; finish_reason "tool_calls".
"""

from __future__ import annotations

from typing import Any

from kvserve.model import Tokenizer
from kvserve.runtime import CompletionOutput, RequestOutput
from kvserve.server.formatting import (
    CHOICE_NULLS,
    SYSTEM_FINGERPRINT,
    VLLM_NULLS,
    StreamCursor,
    chat_logprobs,
    finish_reason,
    prompt_logprobs,
    usage,
)
from kvserve.server.tools.calls import ToolPlan
from kvserve.server.tools.parsers import ToolStream

# Message fields of vLLM's that kvserve has no value for (no refusals, audio, reasoning).
MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                 "reasoning": None}


class ChatFormatter:
    """Bodies for one chat request. `usage_chunk`: the stream ends with a usage chunk."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, created: int, model: str,
                 want_logprobs: bool, tools: ToolPlan | None = None,
                 usage_chunk: bool = False) -> None:
        self.tokenizer = tokenizer
        self.id = f"chatcmpl-{request_id}"
        self.created = created
        self.model = model
        self.want_logprobs = want_logprobs
        self.usage_chunk_follows = usage_chunk
        self._role_sent: set[int] = set()
        self._cursor = StreamCursor()
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}
        self._called: set[int] = set()  # choices that streamed a call

    def _finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        reason = finish_reason(c)
        if (called and reason == "stop" and self.tools is not None
                and self.tools.finishes_with_tool_calls):
            return "tool_calls"
        return reason

    def _message(self, c: CompletionOutput) -> tuple[dict[str, Any], bool]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text} | MESSAGE_NULLS
        if self.tools is None:
            return message, False
        parsed = self.tools.parse(c.text)
        message["content"] = parsed.content
        if parsed.calls:  # vLLM leaves out an empty list
            message["tool_calls"] = [call.as_dict() for call in parsed.calls]
        return message, bool(parsed.calls)

    def _tool_delta(self, index: int, text: str, ended: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call pieces) of one choice's new text."""
        stream = self._tool_streams.get(index)
        if stream is None:
            assert self.tools is not None
            stream = self._tool_streams[index] = self.tools.stream()
        content, pieces = stream.feed(text)
        if ended:
            tail, more = stream.finish()
            content, pieces = content + tail, pieces + more
        if pieces:
            self._called.add(index)
        return content, [piece.as_dict() for piece in pieces]

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
                "finish_reason": self._finish_reason(c, called), "stop_reason": c.stop_reason,
            } | CHOICE_NULLS)
        return self._head("chat.completion") | {
            "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage([output]),
            "prompt_logprobs": prompt_logprobs(self.tokenizer, output),
            "prompt_token_ids": None, "prompt_text": None} | VLLM_NULLS

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The stream's chunks for what `output` gained since the last call."""
        out = []
        for c in output.outputs:
            if c.index not in self._role_sent:
                self._role_sent.add(c.index)
                out.append(self._head("chat.completion.chunk") | {
                    "choices": [{"index": c.index,
                                 "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": None, "prompt_text": None})
        choices = []
        for c in output.outputs:
            new = self._cursor.take(c.index, c)
            logprobs = new.logprobs if self.want_logprobs else ()
            text, calls = new.text, []
            if self.tools is not None:
                text, calls = self._tool_delta(c.index, new.text, new.ended)
            delta: dict[str, Any] = {}
            if text or logprobs or (new.ended and not calls):  # logprobs may come before text
                delta["content"] = text
            if calls:
                delta = {"content": delta.get("content")} | {"tool_calls": calls}
            if not delta:
                continue
            choice = {"index": c.index, "delta": delta,
                      "logprobs": chat_logprobs(self.tokenizer, logprobs) if logprobs
                      else None,
                      "finish_reason": self._finish_reason(c, c.index in self._called)
                      if new.ended else None}
            if new.ended:
                choice["stop_reason"] = c.stop_reason
            choices.append(choice | {"token_ids": None})
        if choices:
            chunk = self._head("chat.completion.chunk") | {"choices": choices}
            if not self.usage_chunk_follows and all(
                    self._cursor.has_ended(c.index) for c in output.outputs):
                chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
            out.append(chunk)
        return out

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        return self._head("chat.completion.chunk") | {
            "choices": [], "usage": usage([output], whole=False),
            "system_fingerprint": SYSTEM_FINGERPRINT}
