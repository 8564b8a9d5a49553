"""The request's output constraint from OpenAI's `response_format` or vLLM's extras
(`guided_json` / `guided_regex` / `guided_choice`, and `structured_outputs` as vLLM 0.10.2+
names them). At most one may be given; anything kvserve cannot enforce is a 400 naming it,
never ignored."""

from __future__ import annotations

import json
from typing import Any

from kvserve.engine import StructuredOutput
from kvserve.server.errors import APIError

# Backends a client may name: kvserve's grammar library is llguidance whatever is asked, so
# only names that mean "the server's choice" or llguidance itself are accepted.
_BACKENDS = {None, "auto", "guidance", "llguidance"}
_STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "json_object"}
_STRUCTURED_OUTPUTS_IGNORABLE = {"disable_any_whitespace", "disable_fallback",
                                 "disable_additional_properties"}


def structured_output(body: Any) -> StructuredOutput | None:
    """The one constraint `body` (a completion or chat request) asks for, or None."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput.regex(body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.structured_outputs is not None:
        found.extend(_structured_outputs(body.structured_outputs))
    for name in ("guided_grammar", "guided_whitespace_pattern"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is not supported; use guided_json, guided_regex or "
                           "guided_choice (or response_format)", param=name)
    if body.guided_decoding_backend not in _BACKENDS:
        raise APIError(400, f"guided_decoding_backend {body.guided_decoding_backend!r} is not "
                       "available: kvserve enforces structured output with llguidance "
                       "(omit it, or say 'auto' or 'guidance')",
                       param="guided_decoding_backend")
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"give one output constraint, not several ({names})",
                       param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a 'type'",
                       param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format json_schema needs "
                           "{'json_schema': {'name': ..., 'schema': {...}}}",
                           param="response_format.json_schema")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise APIError(400, f"response_format type {kind!r} is not supported; use 'text', "
                   "'json_object' or 'json_schema'", param="response_format.type")


def _structured_outputs(value: Any) -> list[tuple[str, StructuredOutput]]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", param=param)
    unknown = sorted(k for k, v in value.items() if v is not None
                     and k not in _STRUCTURED_OUTPUTS_KEYS | _STRUCTURED_OUTPUTS_IGNORABLE)
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]} is not supported; use json, "
                       "regex, choice or json_object", param=f"{param}.{unknown[0]}")
    found = []
    if value.get("json") is not None:
        found.append((f"{param}.json", _schema(value["json"], f"{param}.json")))
    if value.get("regex") is not None:
        if not isinstance(value["regex"], str):
            raise APIError(400, "structured_outputs.regex must be a string",
                           param=f"{param}.regex")
        found.append((f"{param}.regex", StructuredOutput.regex(value["regex"])))
    if value.get("choice") is not None:
        found.append((f"{param}.choice", _choice(value["choice"], f"{param}.choice")))
    if value.get("json_object"):
        found.append((f"{param}.json_object", StructuredOutput.json_object()))
    return found


def _schema(value: Any, param: str) -> StructuredOutput:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON ({exc})", param=param) from None
    if not isinstance(value, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return StructuredOutput.json_schema(value)


def _choice(value: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.choice(value if isinstance(value, list) else [])
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
