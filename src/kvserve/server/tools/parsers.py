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

from kvserve.server.tools.call_text import CallText


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
class CallDelta:
    """A piece of one streamed call. A call's first piece has its `id` and `name`; the
    `arguments` of its pieces, joined, are the call's arguments."""

    position: int  # the call's index among the choice's calls
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls` item (a first piece names the call, as vLLM's do)."""
        function: dict[str, str] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is None:
            function["arguments"] = self.arguments
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        return head | {"index": self.position, "function": function}


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: tuple[ToolCall, ...]


class ToolStream(abc.ABC):
    """Incremental parsing of one choice's text: `feed` each new piece, `finish` at the end;
    both return (content to send now, call pieces to send now). Content that may still turn
    out to be part of a call is held back until it is known. Made `whole`, a stream sends each
    call in one piece once it is complete, and a call that never completes as content: that
    is how a whole answer is parsed, so its calls equal the pieces streamed."""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """See the class docstring."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[CallDelta]]:
        """See the class docstring."""


def parse_whole(stream: ToolStream, text: str) -> Parsed:
    """A whole answer read by a `whole` stream: its content (None when only calls) and calls."""
    content, pieces = stream.feed(text)
    tail, more = stream.finish()
    content += tail
    calls = [ToolCall(d.name or "", d.arguments, d.id or new_call_id()) for d in pieces + more]
    return Parsed(content if content.strip() or not calls else None, tuple(calls))


class ToolParser(abc.ABC):
    """A named parser; `parse` a whole text, or `stream()` one."""

    name = ""

    def parse(self, text: str) -> Parsed:
        return parse_whole(self.stream(whole=True), text)

    @abc.abstractmethod
    def stream(self, whole: bool = False) -> ToolStream:
        """See the class docstring."""


_START, _END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self, whole: bool = False) -> ToolStream:
        return _HermesStream(whole)


class _HermesStream(ToolStream):
    """Whitespace between and after calls is dropped (the template's line breaks), other text
    is content wherever it is. Inside `<tool_call>`, the name is sent once it is written and
    the arguments as they come (`CallText`); a call of another form is sent when it ends."""

    def __init__(self, whole: bool) -> None:
        self._whole = whole
        self._buffer = ""
        self._call: CallText | None = None  # the open call's text
        self._num_calls = 0  # calls begun (sent or being sent)
        self._sent_name = False
        self._sent_chars = 0  # of the open call's arguments
        self._seen_call = False
        self._blank = ""  # whitespace after a call, sent only if more text follows

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content, pieces = "", []
        while True:
            if self._call is not None:
                end = self._buffer.find(_END)
                if end < 0:  # feed what cannot be the start of the end tag
                    cut = len(self._buffer) - _partial_suffix(self._buffer, _END)
                    self._call.feed(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    pieces += self._progress()
                    return content, pieces
                self._call.feed(self._buffer[:end])
                self._buffer = self._buffer[end + len(_END):]
                text_back, done = self._close()
                content += self._text(text_back)
                pieces += done
                continue
            start = self._buffer.find(_START)
            if start >= 0:
                before = self._buffer[:start]
                if self._seen_call and not before.strip():
                    self._blank = ""
                else:
                    content += self._text(before)
                self._buffer = self._buffer[start + len(_START):]
                self._call = CallText()
                self._sent_name, self._sent_chars = False, 0
                continue
            cut = len(self._buffer) - _partial_suffix(self._buffer, _START)
            content += self._text(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return content, pieces

    def _progress(self) -> list[CallDelta]:
        """Pieces of the open call written since the last ones (none when `whole`)."""
        call = self._call
        assert call is not None
        if self._whole or call.name is None:
            return []
        pieces = []
        if not self._sent_name:
            self._sent_name = True
            self._seen_call = True
            self._num_calls += 1
            pieces.append(CallDelta(self._num_calls - 1, "", call.name, new_call_id()))
        if not call.is_other_form:
            arguments = call.arguments
            if len(arguments) > self._sent_chars:
                pieces.append(CallDelta(self._num_calls - 1, arguments[self._sent_chars:]))
                self._sent_chars = len(arguments)
        return pieces

    def _close(self) -> tuple[str, list[CallDelta]]:
        """The open call has ended: (its text back as content, if it was no call; its last
        pieces)."""
        call = self._call
        assert call is not None
        pieces = self._progress()
        self._call = None
        decoded = _decode_call(call.text)
        streamed = self._sent_name
        if decoded is None:
            return ("", pieces) if streamed else (_START + call.text + _END, [])
        self._seen_call = True
        form_arguments = call.arguments if call.has_complete_arguments and \
            not call.is_other_form else decoded.arguments
        if not streamed:  # whole, or a call of another form whose name never came out
            self._num_calls += 1
            return "", [CallDelta(self._num_calls - 1, form_arguments, decoded.name,
                                  decoded.id)]
        if call.is_other_form and self._sent_chars == 0:
            pieces.append(CallDelta(self._num_calls - 1, decoded.arguments))
        return "", pieces

    def _text(self, text: str) -> str:
        if not self._seen_call:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        out, self._blank = self._blank, ""
        return out

    def finish(self) -> tuple[str, list[CallDelta]]:
        rest, self._buffer = self._buffer, ""
        if self._call is None:
            return self._text(rest), []
        # The model ended (EOS) inside a call, perhaps right after its JSON.
        self._call.feed(rest)
        text_back, pieces = self._close()
        if text_back:
            return self._text(text_back[:-len(_END)]), pieces
        return "", pieces


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self, whole: bool = False) -> ToolStream:
        return _Llama3Stream()


_PYTHON_TAG = "<|python_tag|>"


class _Llama3Stream(ToolStream):
    """The answer is either all calls or all content: decided by its first visible character,
    then held to the end (calls, each in one piece) or sent as it comes (content)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # "calls" | "content"

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
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

    def finish(self) -> tuple[str, list[CallDelta]]:
        rest, self._buffer = self._buffer, ""
        if self._mode == "calls":
            calls = _llama3_calls(rest)
            if calls is None:
                return rest, []
            return "", [CallDelta(i, c.arguments, c.name, c.id) for i, c in enumerate(calls)]
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
