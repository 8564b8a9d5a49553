"""The structured-output, tool-call and streamed chat requests recorded from vLLM
(record_structured.py) and replayed against kvserve (tests/server/test_tool_calls_http.py, which
compares the answers' key sets with tests/server/vllm_key_sets.py)."""

from __future__ import annotations

from typing import Any

from tests.model.arch_configs import base_config

MESSAGES = [{"role": "user", "content": "Use a tool."}]
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}

REQUESTS: dict[str, dict[str, Any]] = {
    "json_schema": {"messages": MESSAGES, "max_tokens": 60, "temperature": 0.0,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": ANSWER}}},
    "tool_required": {"messages": MESSAGES, "max_tokens": 100, "temperature": 0.0,
                      "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    "tool_named": {"messages": MESSAGES, "max_tokens": 100, "temperature": 0.0, "tools": TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "add"}}},
    "json_schema_stream": {"messages": MESSAGES, "max_tokens": 60, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True},
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "answer",
                                                               "schema": ANSWER}}},
    "chat_stream": {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}},
    "tool_required_stream": {"messages": MESSAGES, "max_tokens": 100, "temperature": 0.0,
                             "tools": TOOLS, "tool_choice": "required",
                             "parallel_tool_calls": False, "stream": True},
}


def shape_model() -> dict[str, Any]:
    """The tiny random Llama both servers answer with: room for the tools in the prompt, and
    head_dim 32 (vLLM's CPU attention has no kernel for 16)."""
    return base_config(max_position_embeddings=1024, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2)

