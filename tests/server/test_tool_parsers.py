"""The tool-call parsers on text: whole, and streamed in every split of the text into two or
three pieces (a stream must give the same content and calls whatever the token boundaries)."""

from __future__ import annotations

import json

import pytest

from kvserve.server.tool_parsers import PARSERS, HermesParser, Llama3JsonParser, ToolParser

HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "f", "parameters": {}}'


def _calls(calls) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, object]]]:
    stream = parser.stream()
    content, calls = "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, calls = content + text, calls + new
    text, new = stream.finish()
    return content + text, _calls(calls + new)


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
    for pieces in _splits(text):
        assert _streamed(parser, pieces) == (content, calls), pieces


def test_content_is_streamed_before_a_call_starts() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])  # the tag's start is held back
    assert stream.feed("box> there") == ("<toolbox> there", [])


def test_every_parser_name_resolves() -> None:
    assert {"hermes", "qwen", "llama3_json"} <= set(PARSERS)
