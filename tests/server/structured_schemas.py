"""Twenty JSON schemas for the structured-output tests: nested objects, enums, arrays, required
fields, refs, tuples and patterns. Strings and arrays are bounded so that a random-weight model,
whose every choice the grammar alone shapes, finishes most of them within a test's max_tokens."""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


_INT9 = {"type": "integer", "minimum": 0, "maximum": 9}
_SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "profile": _obj({"nick": {"type": "string", "maxLength": 5},
                                         "verified": {"type": "boolean"}})})}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                   "minItems": 1, "maxItems": 4}}),
    _obj({"points": {"type": "array", "items": _obj({"x": _INT9, "y": _INT9}), "maxItems": 3}}),
    {"type": "array", "items": _INT9, "maxItems": 5},
    {"enum": ["yes", "no", "maybe"]},
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    _obj({"id": _INT9, "extra": {"type": "string", "maxLength": 4}}, required=["id"]),
    _obj({"version": {"const": 2}, "kind": {"const": "event"}}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                              {"type": "boolean"}]}}),
    {"$defs": {"pt": _obj({"x": _INT9, "y": _INT9})},
     **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"a": _obj({"b": _obj({"c": {"enum": [1, 2, 3]}})})}),
    _obj({"pair": {"type": "array", "items": {"type": "string", "maxLength": 3},
                   "minItems": 2, "maxItems": 2}}),
    {"type": "array", "prefixItems": [_INT9, {"enum": ["x", "y"]}], "items": False,
     "minItems": 2},
    _obj({"any": {"enum": [1, "two", None, True]}}),
    _obj({"grid": {"type": "array", "maxItems": 2,
                   "items": {"type": "array", "maxItems": 2,
                             "items": {"type": "integer", "minimum": 0, "maximum": 1}}}}),
    _obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
          "items": {"type": "array", "minItems": 1, "maxItems": 2,
                    "items": _obj({"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 5}})},
          "status": {"enum": ["new", "paid", "shipped"]}, "gift": {"type": "boolean"}}),
]
assert len(SCHEMAS) == 20
