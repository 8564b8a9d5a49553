"""What a request's output must match (a JSON schema, any JSON object, a regex or one of a few
strings): a value object the engine carries, compiled and enforced by the model layer's grammar
backend (kvserve.model.grammar), so the engine stays free of grammar libraries."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as canonical JSON text
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: the pattern
    CHOICE = "choice"  # spec: a JSON list of the allowed strings


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """An output constraint. Equal constraints have equal `key`s: compiled grammars are cached
    by it. The backend ends the output with EOS exactly when the grammar accepts it."""

    kind: StructuredKind
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        # Keys keep their order: the output writes properties in the schema's order.
        return cls(StructuredKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(StructuredKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(StructuredKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice constraint needs a non-empty list of non-empty strings")
        return cls(StructuredKind.CHOICE, json.dumps(list(choices)))

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.spec)
