"""`tool_choice="required"` and a named function on random weights, through a real `kvserve
serve` and the official `openai` client: with parallel calls on (the default) the grammar's
array is bounded, so every answer ends within a budget that fits the largest one, and every
call names a real tool and its arguments validate. The random weights make this a test of the
constraint, not of the model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from kvserve.model import write_random_checkpoint
from kvserve.server.tools.calls import MAX_PARALLEL_CALLS
from tests.data.vllm_responses.structured_requests import ADD, WEATHER, shape_model
from tests.server.harness import ServerProcess

SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "minLength": 1, "maxLength": 8},
    "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query", "limit"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
PROMPTS = ["Use a tool.", "What is the weather in Oslo?", "Add 2 and 40.",
           "Search for cats, then add 1 and 1."]
NUM_SEEDS = 20
# The longest call: search with its query's 8 characters each written as a \uXXXX escape;
# a token is at least one character, so MAX_PARALLEL_CALLS of them always fit this budget.
LONGEST_CALL = len(json.dumps({"name": "search", "parameters": {"query": "\\u0000" * 8,
                                                                 "limit": 5}}))
BUDGET = MAX_PARALLEL_CALLS * (LONGEST_CALL + 2) + 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("forced-tools")
    path = write_random_checkpoint(root / "tiny-llama",
                                   shape_model() | {"max_position_embeddings": 2048}, seed=7)
    server = ServerProcess(path, root / "servers",
                           ["--max-model-len", "2048", "--num-kv-blocks", "2048"])
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _client(server: ServerProcess) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0,
                           timeout=300.0)
    return client, client.models.list().data[0].id


def _streamed_calls(chunks: Any) -> tuple[list[dict[str, str]], str | None, int]:
    """(calls, finish_reason, argument fragments) accumulated from a chat stream."""
    calls: dict[int, dict[str, str]] = {}
    reason, fragments = None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
                    fragments += bool(delta.function.arguments)
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, fragments


def _each_seed(ask: Callable[[int], Any]) -> list[Any]:
    """`ask(seed)` for every seed, ten at a time (the engine batches them, grammars and all)."""
    with ThreadPoolExecutor(max_workers=10) as pool:
        return list(pool.map(ask, range(NUM_SEEDS)))


def _check_calls(calls: list[Any]) -> list[str]:
    """The names of `calls` (openai objects), each checked: a real tool, valid arguments."""
    names = []
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


def _args(model: str, seed: int, **kwargs: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": PROMPTS[seed % len(PROMPTS)]}]
    return dict(model=model, messages=messages, tools=TOOLS, temperature=1.0, seed=seed,
                **kwargs)


def test_required_parallel_calls_always_end_valid(server: ServerProcess) -> None:
    client, model = _client(server)

    def ask(seed: int) -> int:
        args = _args(model, seed, tool_choice="required", max_tokens=BUDGET)
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None
        names = _check_calls(choice.message.tool_calls)
        assert 1 <= len(names) <= MAX_PARALLEL_CALLS
        if seed % 10 == 0:  # the same sample streamed: the same calls, arguments in pieces
            calls, reason, _ = _streamed_calls(
                client.chat.completions.create(**args, stream=True))
            assert reason == "tool_calls"
            assert [(c["name"], c["arguments"]) for c in calls] == \
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        return len(names)

    num_calls = _each_seed(ask)
    print(f"\nrequired, parallel: {NUM_SEEDS} of {NUM_SEEDS} answers valid, "
          f"{sum(num_calls)} calls ({min(num_calls)}-{max(num_calls)} per answer, "
          f"{num_calls.count(MAX_PARALLEL_CALLS)} at the bound)")


def test_required_single_call_without_parallel(server: ServerProcess) -> None:
    client, model = _client(server)

    def ask(seed: int) -> None:
        choice = client.chat.completions.create(**_args(
            model, seed, tool_choice="required", parallel_tool_calls=False,
            max_tokens=LONGEST_CALL + 2)).choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert len(_check_calls(choice.message.tool_calls)) == 1

    _each_seed(ask)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_named_function_always_gives_its_valid_call(server: ServerProcess, name: str) -> None:
    client, model = _client(server)

    def ask(seed: int) -> None:
        args = _args(model, seed, max_tokens=LONGEST_CALL,
                     tool_choice={"type": "function", "function": {"name": name}})
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        assert _check_calls(choice.message.tool_calls) == [name]
        if seed % 5 == 0:
            calls, _, _ = _streamed_calls(client.chat.completions.create(**args, stream=True))
            assert [(c["name"], c["arguments"]) for c in calls] == \
                [(name, choice.message.tool_calls[0].function.arguments)]

    _each_seed(ask)
