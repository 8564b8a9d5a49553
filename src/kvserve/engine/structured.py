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


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's offline constraint (`SamplingParams(structured_outputs=...)`, its field names):
    exactly one of `json` (a schema, as a dict or JSON text), `regex`, `choice`, `json_object`.
    `grammar`, `structural_tag`, `whitespace_pattern` and `disable_additional_properties`
    change what the output may be in ways kvserve does not implement: a ValueError names them.
    `disable_any_whitespace` is what kvserve always does."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def to_structured(self) -> StructuredOutput:
        """The engine's constraint; ValueError for what kvserve cannot enforce."""
        for name in ("grammar", "structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"{type(self).__name__}.{name} is not supported; use json, "
                                 "regex, choice or json_object")
        if self.disable_additional_properties:
            raise ValueError(f"{type(self).__name__}.disable_additional_properties is not "
                             "supported; write additionalProperties: false in the schema")
        found = [name for name in ("json", "regex", "choice", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(found) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one of json, regex, choice "
                             f"or json_object, got {found or 'none'}")
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{type(self).__name__}.json must be a JSON schema object")
            return StructuredOutput.json_schema(schema)
        if self.regex is not None:
            return StructuredOutput.regex(self.regex)
        if self.choice is not None:
            return StructuredOutput.choice(list(self.choice))
        return StructuredOutput.json_object()


# Backends a caller may name: kvserve's grammar library is llguidance whatever is asked.
_BACKENDS = (None, "auto", "guidance", "llguidance")


@dataclass(frozen=True, slots=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for the same (`SamplingParams(guided_decoding=...)`, vLLM <= 0.10),
    with its `backend` and `disable_fallback`."""

    backend: str | None = None
    disable_fallback: bool = False

    def to_structured(self) -> StructuredOutput:
        if self.backend not in _BACKENDS:
            raise ValueError(f"GuidedDecodingParams.backend {self.backend!r} is not available: "
                             "kvserve enforces structured output with llguidance (omit it, or "
                             "say 'auto' or 'guidance')")
        return StructuredOutputsParams.to_structured(self)
