"""One tool call's JSON text, followed as the model writes it, so its arguments can stream.

A call is written `{"name": "F", "arguments": {...}}` (or `"parameters"`, vLLM's key for forced
calls), whitespace allowed between the JSON tokens. `CallText` reads the name as soon as its
string is closed and the arguments object's text as far as it has come; `closed` says where the
call's object ends. Text of another form (keys in another order, arguments given as a string) is
`is_other_form`: the caller then reads the call whole when it ends.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
# The head of a call, token by token: literals, and the two strings read ("NAME", "KEY").
_HEAD = ("{", "name", ":", "NAME", ",", "KEY", ":")


class CallText:
    """The text of one call so far; `feed` appends. Reads nothing past the call's object."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.is_other_form = False
        self._args_start: int | None = None
        self._args_end: int | None = None  # just after the arguments' closing brace
        self.closed: int | None = None  # just after the call's closing brace
        self._pos = 0  # next character the arguments scan reads
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, more: str) -> None:
        self.text += more
        if self.is_other_form or self.closed is not None:
            return
        if self._args_start is None:
            self._read_head()
        if self._args_start is not None:
            self._read_arguments()

    @property
    def arguments(self) -> str:
        """The arguments' text written so far ("" before they start)."""
        if self._args_start is None:
            return ""
        end = self._args_end if self._args_end is not None else self._pos
        return self.text[self._args_start:end]

    @property
    def has_complete_arguments(self) -> bool:
        return self._args_end is not None

    def _read_head(self) -> None:
        """Find the name and where the arguments start; mark any other form."""
        text, pos = self.text, 0
        for step in _HEAD:
            pos = _skip_whitespace(text, pos)
            if pos >= len(text):
                return
            if step in ("{", ":", ","):
                if text[pos] != step:
                    self.is_other_form = True
                    return
                pos += 1
                continue
            end = _string_end(text, pos)
            if end is None:
                if text[pos] != '"':
                    self.is_other_form = True
                return
            value = json.loads(text[pos:end])
            if (step == "name" and value != "name") or \
                    (step == "KEY" and value not in _ARGUMENT_KEYS) or not isinstance(value, str):
                self.is_other_form = True
                return
            if step == "NAME":
                self.name = value
            pos = end
        pos = _skip_whitespace(text, pos)
        if pos >= len(text):
            return
        if text[pos] != "{":
            self.is_other_form = True
            return
        self._args_start = self._pos = pos

    def _read_arguments(self) -> None:
        """Advance over the arguments object (strings and nesting tracked), then to the call's
        closing brace."""
        # Invariant: text[_args_start:_pos] is arguments text; _depth counts its open braces.
        text = self.text
        while self._pos < len(text):
            char = text[self._pos]
            self._pos += 1
            if self._args_end is not None:  # after the arguments: the call's closing brace
                if char == "}":
                    self.closed = self._pos
                    return
                if char not in _WHITESPACE:
                    self.is_other_form = True
                    return
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_end = self._pos


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Just after the JSON string starting at `pos` (a quote), or None if it is not closed."""
    if text[pos] != '"':
        return None
    escaped = False
    for i in range(pos + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None
