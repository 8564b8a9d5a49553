"""Scoring a model's answers to questions with known answers: do the values answer the question
(after normalization), and what did the JSON grammar let the model write: every string and
number value's length, and whether an answer cut by `max_tokens` stopped inside a value.

Pure functions of text, so the real-model checks and their tests share one scorer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"[a-z0-9]+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")


def normalize(text: str) -> str:
    """Lowercase words joined by single spaces, punctuation dropped, a leading "the" dropped:
    "The United Kingdom." and "united kingdom" compare equal."""
    words = _WORD.findall(text.lower())
    if words[:1] == ["the"]:
        words = words[1:]
    return " ".join(words)


def value_matches(expected: Any, got: Any) -> bool:
    """A JSON value answers the question: numbers equal (an integral float equals the
    integer), strings equal after `normalize`."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return expected is got
    if isinstance(expected, int | float):
        return isinstance(got, int | float) and math.isclose(got, expected, rel_tol=1e-9,
                                                             abs_tol=1e-9)
    if isinstance(expected, str):
        return isinstance(got, str) and normalize(got) == normalize(expected)
    return bool(expected == got)


def fields_match(expected: dict[str, Any], got: Any) -> bool:
    """Every expected field is present in the object `got` with a matching value."""
    return isinstance(got, dict) and all(k in got and value_matches(v, got[k])
                                         for k, v in expected.items())


def text_answers(expected: dict[str, Any], text: str) -> bool:
    """Free text answers the question: each expected string appears in it as whole words,
    each expected number as one of its numbers (thousands separators ignored)."""
    words = f" {normalize(text)} "
    numbers = [float(n) for n in _NUMBER.findall(text.replace(",", ""))]
    for value in expected.values():
        if isinstance(value, str):
            if f" {normalize(value)} " not in words:
                return False
        elif not any(math.isclose(n, value, rel_tol=1e-9, abs_tol=1e-9) for n in numbers):
            return False
    return True


@dataclass(frozen=True, slots=True)
class JsonValue:
    """One string or number value of a (possibly cut) JSON text: `length` in characters
    (a string's without its quotes); `complete` False when the text ends inside it."""

    kind: str  # "string" | "number"
    length: int
    complete: bool


def scan_values(text: str) -> list[JsonValue]:
    """The string and number values of a JSON text, object keys excluded, in order; the text
    may be a valid prefix (an answer cut by `max_tokens`), whose last value may be open."""
    values: list[JsonValue] = []
    stack: list[str] = []  # "{" or "["
    expect_key = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j, closed = i + 1, False
            while j < n:
                if text[j] == "\\":
                    j += 2
                    continue
                if text[j] == '"':
                    closed = True
                    break
                j += 1
            is_key = bool(stack) and stack[-1] == "{" and expect_key
            if not is_key:
                values.append(JsonValue("string", min(j, n) - i - 1, closed))
            i = j + 1
            continue
        if c in "-0123456789":
            j = i
            while j < n and text[j] in _NUMBER_CHARS:
                j += 1
            values.append(JsonValue("number", j - i, j < n))
            i = j
            continue
        if c == "{":
            stack.append("{")
            expect_key = True
        elif c == "[":
            stack.append("[")
            expect_key = False
        elif c in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif c == ":":
            expect_key = False
        elif c == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        i += 1
    return values


def is_cut_inside_value(text: str) -> bool:
    """The text ends inside a string or number value (with `finish_reason: length`, the
    budget ran out while the model was still writing that value)."""
    values = scan_values(text)
    return bool(values) and not values[-1].complete and text.rstrip() == text
