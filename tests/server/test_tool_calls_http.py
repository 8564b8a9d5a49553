"""Tool calls through a real `kvserve serve` and the official `openai` client: `required` and
a named function forced by the grammar on random weights (every call's arguments validate),
`auto` parsed from a rigged model's Hermes-style output, whole and streamed; 400s otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config
from tests.server.harness import ServerProcess
from tests.server.tool_model import (
    EXPECTED_CALL,
    EXPECTED_CONTENT,
    TOOLS,
    write_tool_call_checkpoint,
)

MESSAGES = [{"role": "user", "content": "Use a tool."}]
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
LONG_CONTEXT = ["--max-model-len", "1024"]  # the template writes the tools into the prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A random Llama with room for the tools in its prompt."""
    root = tmp_path_factory.mktemp("tools-llama")
    path = write_random_checkpoint(root / "tiny-llama", base_config(max_position_embeddings=1024),
                                   seed=7)
    server = ServerProcess(path, root / "servers", LONG_CONTEXT)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _client(server: ServerProcess) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0,
                           timeout=120.0)
    return client, client.models.list().data[0].id


def _streamed(chunks: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls, finish_reason) accumulated from a chat stream, as clients do."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_required_always_gives_valid_calls(server: ServerProcess) -> None:
    client, model = _client(server)
    for seed in range(6):
        args = dict(model=model, messages=MESSAGES, tools=FORCED_TOOLS, tool_choice="required",
                    max_tokens=100, temperature=1.0, seed=seed, parallel_tool_calls=False)
        response = client.chat.completions.create(**args)  # type: ignore[call-overload]
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, calls, reason = _streamed(client.chat.completions.create(**args, stream=True))
        assert reason == "tool_calls" and not content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(call.function.name, json.loads(call.function.arguments))]


def test_required_parallel_calls_validate_or_are_cut(server: ServerProcess) -> None:
    """Parallel calls: an open array that random weights close only by chance. Every answer
    that ends is a list of valid calls; one cut by max_tokens has none (its text is content)."""
    client, model = _client(server)
    ended = 0
    for seed in range(4):
        choice = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=FORCED_TOOLS, tool_choice="required",
            max_tokens=480, temperature=1.0, seed=seed).choices[0]  # type: ignore[arg-type]
        if choice.finish_reason == "length":
            assert not choice.message.tool_calls and choice.message.content.startswith("[{")
            continue
        ended += 1
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    print(f"\nparallel required calls: {ended} of 4 ended within 480 tokens")


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_function_always_gives_its_valid_call(server: ServerProcess, name: str) -> None:
    client, model = _client(server)
    for seed in range(4):
        args = dict(model=model, messages=MESSAGES, tools=FORCED_TOOLS, max_tokens=120,
                    tool_choice={"type": "function", "function": {"name": name}},
                    temperature=1.0, seed=seed)
        choice = client.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
        assert choice.finish_reason == "stop"
        (call,) = choice.message.tool_calls
        assert call.function.name == name and choice.message.content is None
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
        _, calls, _ = _streamed(client.chat.completions.create(**args, stream=True))
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(name, call.function.arguments)]


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hermes-model")
    path = write_tool_call_checkpoint(root / "tool-llama")
    server = ServerProcess(path, root / "servers",
                           ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            *LONG_CONTEXT])
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_auto_parses_the_models_hermes_output(hermes_server: ServerProcess) -> None:
    client, model = _client(hermes_server)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    args = dict(model=model, messages=messages, tools=TOOLS, max_tokens=20, temperature=0.0)
    free = client.chat.completions.create(**args, tool_choice="none")  # type: ignore
    assert "<tool_call>" in (free.choices[0].message.content or "")  # what the model writes
    choice = client.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == EXPECTED_CONTENT
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == EXPECTED_CALL
    content, calls, reason = _streamed(client.chat.completions.create(**args, stream=True))
    assert reason == "tool_calls" and content == EXPECTED_CONTENT
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [EXPECTED_CALL]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"tools": FORCED_TOOLS}, "needs the server started with --enable-auto-tool-choice"),
    ({"tools": FORCED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"},
     "only {'type': 'function'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": FORCED_TOOLS, "tool_choice": "sometimes"}, "is not supported"),
    ({"tools": FORCED_TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "without response_format"),
])
def test_unsupported_tool_requests_are_a_400(server: ServerProcess, kwargs: dict[str, Any],
                                             needle: str) -> None:
    client, model = _client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       **kwargs)  # type: ignore[call-overload]
    assert needle in info.value.message
