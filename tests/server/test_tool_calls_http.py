"""Tool calls through a real `kvserve serve` and the official `openai` client: `required` and
a named function forced by the grammar on random weights (every call's arguments validate),
`auto` parsed from a rigged model's Hermes-style output, whole and streamed; 400s otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from kvserve.model import write_random_checkpoint
from tests.data.vllm_responses.structured_requests import (
    ADD,
    MESSAGES,
    REQUESTS,
    WEATHER,
    shape_model,
)
from tests.data.vllm_responses.structured_requests import TOOLS as FORCED_TOOLS
from tests.server.harness import ServerProcess
from tests.server.tool_model import (
    EXPECTED_CALL,
    EXPECTED_CONTENT,
    TOOLS,
    write_tool_call_checkpoint,
)
from tests.server.vllm_key_sets import (
    assert_same_key_sets,
    body_key_sets,
    chunk_kind,
    key_sets,
    stream_key_sets,
)

SCHEMAS = {"get_weather": WEATHER, "add": ADD}
LONG_CONTEXT = ["--max-model-len", "1024"]  # the template writes the tools into the prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A random Llama with room for the tools in its prompt."""
    root = tmp_path_factory.mktemp("tools-llama")
    path = write_random_checkpoint(root / "tiny-llama", shape_model(), seed=7)
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


def _streamed(chunks: Any, fragments: list[str] | None = None,
              ) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, calls, finish_reason) accumulated from a chat stream, as clients do; the
    argument pieces are appended to `fragments`."""
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
                    if delta.function.arguments and fragments is not None:
                        assert not delta.id, "a call's first piece names it, then arguments"
                        fragments.append(delta.function.arguments)
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
        fragments: list[str] = []
        content, calls, reason = _streamed(client.chat.completions.create(**args, stream=True),
                                           fragments)
        assert reason == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(call.function.name, call.function.arguments)]
        assert len(fragments) > 1 and "".join(fragments) == call.function.arguments


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
    fragments: list[str] = []
    content, calls, reason = _streamed(client.chat.completions.create(**args, stream=True),
                                       fragments)
    assert reason == "tool_calls" and content == EXPECTED_CONTENT
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")
    # The arguments stream as the model writes them, as vLLM's Hermes parser sends them.
    assert len(fragments) > 1, fragments
    assert "".join(fragments) == call.function.arguments


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


RECORDED = Path(__file__).parents[1] / "data" / "vllm_responses" / "structured_responses.json"


def _their_call_keys(chunks: list[dict[str, Any]]) -> dict[str, set[frozenset[str]]]:
    """A whole answer's tool-call object as vLLM's streamed pieces imply it: the opening
    piece's keys less the stream's `index`, its function's with the arguments."""
    head = next(d for c in chunks if chunk_kind(c) == "tool"
                for d in c["choices"][0]["delta"]["tool_calls"] if "id" in d)
    return {"call": {frozenset(head) - {"index"}},
            "call.function": {frozenset(head["function"]) | {"arguments"}}}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_key_sets_match_vllms(server: ServerProcess, name: str) -> None:
    """kvserve's answers to the recorded requests have vLLM's keys, object by object, chunk
    kind by chunk kind. vLLM's random-weight answers to the tool requests were cut by
    max_tokens before a call was complete, so its whole answers have no `tool_calls`:
    kvserve's calls are compared with the calls of vLLM's stream."""
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))["responses"]
    body = {"model": _client(server)[1]} | REQUESTS[name]
    with server.client() as http:
        if body.get("stream"):
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                ours = [json.loads(line[6:]) for line in response.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]
            theirs = recorded[name]["chunks"]
            kinds = [chunk_kind(c) for c in ours]
            assert kinds[0] == "role" and "finish" in kinds, kinds
            assert ("tool" in kinds) == ("tool" in [chunk_kind(c) for c in theirs]), kinds
            compared = assert_same_key_sets(stream_key_sets(ours), stream_key_sets(theirs),
                                            name)
            assert ours[-1].get("system_fingerprint") and \
                sum("system_fingerprint" in c for c in ours) == 1
        else:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == recorded[name]["status"] == 200
            ours_body, their_body = response.json(), recorded[name]["body"]
            calls = ours_body["choices"][0]["message"].pop("tool_calls", None)
            assert (calls is not None) == name.startswith("tool_"), ours_body
            compared = assert_same_key_sets(body_key_sets(ours_body), body_key_sets(their_body),
                                            name)
            if calls is not None:
                mine: dict[str, set[frozenset[str]]] = {}
                for call in calls:
                    key_sets(call, "call", mine)
                compared += assert_same_key_sets(
                    mine, _their_call_keys(recorded["tool_required_stream"]["chunks"]), name)
    assert compared >= 4, compared
