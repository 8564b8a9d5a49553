"""`tools` and `tool_choice` on chat completions: which calls a request allows, the grammar
that forces them, and the answer's text turned into `tool_calls` (whole and streamed).

`none`: plain text. `auto`: the model decides; its text is parsed by `--tool-call-parser`
(needs `--enable-auto-tool-choice`, as vLLM does). `required`: a grammar forces a JSON array of
1 to `MAX_PARALLEL_CALLS` `{"name", "parameters"}` calls of the given tools (vLLM's form), their
parameters validated by each function's schema; the bound makes the array end, so a model that
would write calls forever still gives calls. A named function: a grammar forces its arguments
object. Anything else is a 400 that says what is supported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine import StructuredOutput
from kvserve.server.errors import APIError
from kvserve.server.tools.call_text import CallText
from kvserve.server.tools.flags import ToolSettings
from kvserve.server.tools.parsers import (
    PARSERS,
    CallDelta,
    Parsed,
    ToolParser,
    ToolStream,
    new_call_id,
    parse_whole,
)

# The most calls one `required` answer holds with parallel_tool_calls (the default).
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools allow. `constraint`: the grammar forcing the calls (required,
    named), else None. `parser`: how `auto` text is read, else None."""

    mode: str  # "auto" | "required" | "named"
    constraint: StructuredOutput | None
    parser: ToolParser | None
    function: str | None = None  # the named function

    def parse(self, text: str) -> Parsed:
        """The answer's content and calls."""
        return parse_whole(self.stream(whole=True), text)

    def stream(self, whole: bool = False) -> ToolStream:
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.stream(whole)
        return _ForcedStream(self.function, whole)

    @property
    def finishes_with_tool_calls(self) -> bool:
        """A choice whose text parsed into calls ends with finish_reason "tool_calls" (a named
        choice keeps "stop", as OpenAI's does)."""
        return self.mode != "named"


def plan_tools(tools: Sequence[dict[str, Any]] | None, tool_choice: Any,
               settings: ToolSettings, parallel_tool_calls: bool = True) -> ToolPlan | None:
    """The request's plan, or None when no tool call can come out (no tools, or "none").
    `parallel_tool_calls=False` makes `required` force exactly one call."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None
    if not functions:
        raise APIError(400, f"tool_choice {_show(tool_choice)} needs tools", param="tool_choice")
    if tool_choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise APIError(400, "tool_choice 'auto' (the default when tools are given) needs "
                           "the server started with --enable-auto-tool-choice and "
                           "--tool-call-parser; or send tool_choice 'required', 'none' or a "
                           "named function", param="tool_choice")
        return ToolPlan("auto", None, PARSERS[settings.tool_call_parser]())
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "maxItems": MAX_PARALLEL_CALLS if parallel_tool_calls else 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return ToolPlan("required", StructuredOutput.json_schema(schema), None)
    if (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools "
                           f"({', '.join(functions)})", param="tool_choice")
        return ToolPlan("named", StructuredOutput.json_schema(functions[name]), None, name)
    raise APIError(400, f"tool_choice {_show(tool_choice)} is not supported; use 'none', "
                   "'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                   param="tool_choice")


def _functions(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema; a tool kvserve cannot offer is a 400."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} "
                           f"tools are supported, got type {tool.get('type')!r}",
                           param=f"tools[{i}]")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string",
                           param=f"tools[{i}].function.name")
        params = function.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        out[name] = params
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)[:200]


class _ForcedStream(ToolStream):
    """Grammar-forced calls as they are written: a named function's answer is its arguments
    object; `required`'s is a JSON array of calls. Each call's first piece names it, then its
    arguments stream. `whole`: the calls are sent at the end if the answer is complete, else
    the answer is content (max_tokens cut it)."""

    def __init__(self, function: str | None, whole: bool) -> None:
        self._function = function  # None: a `required` array
        self._whole = whole
        self._text = ""
        self._pieces: list[CallDelta] = []  # held when whole
        self._items: list[CallText] = []  # the array's calls, the last one perhaps open
        self._sent: list[int] = []  # argument characters sent, per array call
        self._heads: set[int] = set()  # calls whose first piece (the name) is out
        self._rest = 0  # where the text after the last closed call starts
        self._is_complete = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text += text
        pieces = self._named(text) if self._function is not None else self._required(text)
        if self._whole:
            self._pieces += pieces
            return "", []
        return "", pieces

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._function is not None:
            value = _loads(self._text)
            self._is_complete = isinstance(value, dict)
        if not self._whole:
            return "", []
        if not self._is_complete:
            return self._text, []
        # One piece per call, the arguments exactly as streamed.
        calls: dict[int, CallDelta] = {}
        for piece in self._pieces:
            head = calls.get(piece.position)
            calls[piece.position] = piece if head is None else CallDelta(
                piece.position, head.arguments + piece.arguments, head.name, head.id)
        return "", [calls[i] for i in sorted(calls)]

    def _named(self, text: str) -> list[CallDelta]:
        pieces = []
        if not self._heads:
            self._heads.add(0)
            pieces.append(CallDelta(0, "", self._function, new_call_id()))
        if text:
            pieces.append(CallDelta(0, text))
        return pieces

    def _required(self, text: str) -> list[CallDelta]:
        # Invariant: text before `_rest` belongs to closed calls or the array's punctuation.
        pieces: list[CallDelta] = []
        while True:
            if self._items and self._items[-1].closed is None:
                item = self._items[-1]
                if text:
                    item.feed(text)
                    text = ""
                pieces += self._progress(len(self._items) - 1)
                if item.closed is None:
                    return pieces
                self._rest = len(self._text) - (len(item.text) - item.closed)
            start = self._text.find("{", self._rest)
            if start < 0:
                self._is_complete = self._text[self._rest:].rstrip().endswith("]")
                return pieces
            self._items.append(CallText())
            self._sent.append(0)
            text = self._text[start:]

    def _progress(self, position: int) -> list[CallDelta]:
        """The pieces of call `position` written since its last ones."""
        item = self._items[position]
        pieces = []
        if position not in self._heads and item.name is not None:
            self._heads.add(position)
            pieces.append(CallDelta(position, "", item.name, new_call_id()))
        arguments = item.arguments
        if len(arguments) > self._sent[position]:
            pieces.append(CallDelta(position, arguments[self._sent[position]:]))
            self._sent[position] = len(arguments)
        return pieces
