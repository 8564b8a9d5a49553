"""Tool-call parsers for `tool_choice="auto"` (`--tool-call-parser`): a model's text turned
into content and OpenAI `tool_calls`, whole or as a stream of deltas.

`hermes` (also `qwen`): calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
anywhere in the text, the Hermes/Qwen 2.5+ chat templates' format. `llama3_json`: the whole
answer is one JSON call `{"name": ..., "parameters": {...}}` (or several joined by `;`),
optionally after `<|python_tag|>`, Llama 3.1+'s format. Text that does not parse as a call
stays content: a parser never drops what the model wrote.
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_json(value: Any) -> ToolCall | None:
    """A call from a decoded `{"name", "arguments" | "parameters"}` object, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolStream(abc.ABC):
    """Incremental parsing of one choice's text: `feed` each new piece, `finish` at the end;
    both return (content to send now, calls completed now). Content that may still turn out to
    be part of a call is held back until it is known."""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """See the class docstring."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """See the class docstring."""


class ToolParser(abc.ABC):
    """A named parser; `parse` a whole text, or `stream()` one."""

    name = ""

    @abc.abstractmethod
    def parse(self, text: str) -> Parsed:
        """See the class docstring."""

    @abc.abstractmethod
    def stream(self) -> ToolStream:
        """See the class docstring."""


_START, _END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> Parsed:
        stream = _HermesStream()
        content, calls = stream.feed(text)
        tail, more = stream.finish()
        content += tail
        calls += more
        return Parsed(content if content.strip() or not calls else None, tuple(calls))

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    """Whitespace between and after calls is dropped (the template's line breaks), other text
    is content wherever it is."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._seen_call = False
        self._blank = ""  # whitespace after a call, sent only if more text follows

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(_END)
                if end < 0:
                    return content, calls
                body, self._buffer = self._buffer[:end], self._buffer[end + len(_END):]
                self._in_call = False
                call = _decode_call(body)
                if call is None:  # not a call after all: give the text back as content
                    content += self._text(_START + body + _END)
                else:
                    calls.append(call)
                    self._seen_call = True
                continue
            start = self._buffer.find(_START)
            if start >= 0:
                before = self._buffer[:start]
                if self._seen_call and not before.strip():
                    self._blank = ""
                else:
                    content += self._text(before)
                self._buffer = self._buffer[start + len(_START):]
                self._in_call = True
                continue
            cut = len(self._buffer) - _partial_suffix(self._buffer, _START)
            content += self._text(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return content, calls

    def _text(self, text: str) -> str:
        if not self._seen_call:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        out, self._blank = self._blank, ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return self._text(rest), []
        self._in_call = False
        call = _decode_call(rest)  # the model ended (EOS) right after the call's JSON
        return ("", [call]) if call is not None else (self._text(_START + rest), [])


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> Parsed:
        calls = _llama3_calls(text)
        if calls is None:
            return Parsed(text, ())
        return Parsed(None, tuple(calls))

    def stream(self) -> ToolStream:
        return _Llama3Stream()


_PYTHON_TAG = "<|python_tag|>"


class _Llama3Stream(ToolStream):
    """The answer is either all calls or all content: decided by its first visible character,
    then held to the end (calls) or sent as it comes (content)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # "calls" | "content"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                return "", []
            self._mode = "calls" if head.startswith(("{", _PYTHON_TAG)) else "content"
        if self._mode == "calls":
            return "", []
        out, self._buffer = self._buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        if self._mode == "calls":
            calls = _llama3_calls(rest)
            return ("", calls) if calls is not None else (rest, [])
        return rest, []


def _llama3_calls(text: str) -> list[ToolCall] | None:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            value, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _decode_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "qwen25": HermesParser,
    "llama3_json": Llama3JsonParser, "llama4_json": Llama3JsonParser,
}
