"""The tool-call parsers and the grammar-forced calls on text: whole, and streamed in every
split of the text into two or three pieces (a stream must give the same content and calls,
arguments character for character, whatever the token boundaries)."""

from __future__ import annotations

import json

import pytest

from kvserve.server.tools.calls import ToolPlan, plan_tools
from kvserve.server.tools.flags import ToolSettings
from kvserve.server.tools.parsers import (
    PARSERS,
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolParser,
)

HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "f", "parameters": {}}'


def _calls(calls: list[ToolCall] | tuple[ToolCall, ...]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _merged(pieces: list[CallDelta]) -> list[ToolCall]:
    """Calls from their streamed pieces, as a client joins them: the first names a call."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        if piece.name is not None:
            assert piece.position not in calls and piece.id
            calls[piece.position] = ToolCall(piece.name, "", piece.id)
        call = calls[piece.position]
        calls[piece.position] = ToolCall(call.name, call.arguments + piece.arguments, call.id)
    return [calls[i] for i in sorted(calls)]


def _streamed(parser: ToolParser | ToolPlan, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream = parser.stream()
    content, deltas = "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, deltas = content + text, deltas + new
    text, new = stream.finish()
    return content + text, _merged(deltas + new)


def _splits(text: str) -> list[list[str]]:
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7)
            for j in range(i, len(text), 5)]
    return out


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    (HermesParser(), HERMES, "Let me look. ",
     [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    (HermesParser(), "no calls, just <tool text", "no calls, just <tool text", []),
    (HermesParser(), "<tool_call>not json</tool_call> after",
     "<tool_call>not json</tool_call> after", []),
    # EOS right after the JSON, no end tag
    (HermesParser(), '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),
    (Llama3JsonParser(), LLAMA3, "", [("add", {"a": 1}), ("f", {})]),
    (Llama3JsonParser(), '  {"name": "g", "arguments": {"x": [1]}}', "", [("g", {"x": [1]})]),
    (Llama3JsonParser(), "Plain answer {not a call}", "Plain answer {not a call}", []),
    (Llama3JsonParser(), '{"name": "g", "arguments": {"x": 1}',  # cut: stays content
     '{"name": "g", "arguments": {"x": 1}', []),
])
def test_whole_and_every_streamed_split_agree(parser: ToolParser, text: str, content: str,
                                              calls: list[tuple[str, object]]) -> None:
    parsed = parser.parse(text)
    assert (parsed.content or "", _calls(parsed.calls)) == (content, calls)
    whole = [(c.name, c.arguments) for c in parsed.calls]
    for pieces in _splits(text):
        streamed_content, streamed = _streamed(parser, pieces)
        assert streamed_content == content, pieces
        assert [(c.name, c.arguments) for c in streamed] == whole, pieces


def test_hermes_arguments_stream_as_they_are_written() -> None:
    stream = HermesParser().stream()
    assert stream.feed('<tool_call>{"name": "get_') == ("", [])
    _, (head, first) = stream.feed('weather", "arguments": {"ci')
    assert (head.name, head.arguments, first.name, first.arguments) == \
        ("get_weather", "", None, '{"ci')
    assert stream.feed('ty": "Oslo"}}</tool') == ("", [CallDelta(0, 'ty": "Oslo"}')])
    assert stream.feed("_call>") == ("", [])


FORCED_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                for n in ("f", "g")]
NO_AUTO = ToolSettings(enable_auto_tool_choice=False, tool_call_parser=None)
REQUIRED = plan_tools(FORCED_TOOLS, "required", NO_AUTO)
NAMED = plan_tools(FORCED_TOOLS, {"type": "function", "function": {"name": "g"}}, NO_AUTO)
ARRAY = ('[{"name": "f", "parameters": {"a": [1, {"b": "}]\\"}"}]}}, '
         '{"name": "g", "parameters": {}}]')


@pytest.mark.parametrize(("plan", "text", "calls"), [
    (REQUIRED, ARRAY, [("f", {"a": [1, {"b": '}]"}'}]}), ("g", {})]),
    (NAMED, '{"x": {"y": "}"}}', [("g", {"x": {"y": "}"}})]),
])
def test_forced_calls_stream_as_they_are_written(plan: ToolPlan | None, text: str,
                                                  calls: list[tuple[str, object]]) -> None:
    assert plan is not None
    parsed = plan.parse(text)
    assert parsed.content is None and _calls(parsed.calls) == calls
    whole = [(c.name, c.arguments) for c in parsed.calls]
    for pieces in _splits(text):
        content, streamed = _streamed(plan, pieces)
        assert content == "" and [(c.name, c.arguments) for c in streamed] == whole, pieces
    stream = plan.stream()
    _, deltas = stream.feed(text)
    assert len(deltas) == 2 * len(calls)  # per call: its name, then its arguments
    # Cut by max_tokens: the whole answer is content; its stream sent what it had.
    cut = text[:-2]
    assert plan.parse(cut).content == cut and not plan.parse(cut).calls


def test_content_is_streamed_before_a_call_starts() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])  # the tag's start is held back
    assert stream.feed("box> there") == ("<toolbox> there", [])


def test_every_parser_name_resolves() -> None:
    assert {"hermes", "qwen", "llama3_json"} <= set(PARSERS)
