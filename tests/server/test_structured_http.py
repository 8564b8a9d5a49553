"""Structured output through a real `kvserve serve` and the official `openai` client, on tiny
random Llama and Qwen2 checkpoints: random weights make every answer the grammar's doing, so a
valid answer is a test of the constraint, not of the model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from kvserve.engine import StructuredOutput
from kvserve.model import Tokenizer, write_random_checkpoint
from kvserve.model.grammar import Grammars
from tests.model.arch_configs import ARCH_CONFIGS
from tests.server.harness import ServerProcess
from tests.server.structured_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("structured-qwen")
    path = write_random_checkpoint(root / "tiny-qwen2", ARCH_CONFIGS["qwen2_bias_tied"], seed=5)
    server = ServerProcess(path, root / "servers")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request: pytest.FixtureRequest, server: ServerProcess,
           qwen_server: ServerProcess) -> tuple[openai.OpenAI, str, Path]:
    chosen = server if request.param == "llama" else qwen_server
    client = openai.OpenAI(base_url=f"{chosen.url}/v1", api_key="dummy", max_retries=0,
                           timeout=120.0)
    model = client.models.list().data[0].id
    return client, model, Path(model)


def is_grammar_prefix(model_dir: Path, constraint: StructuredOutput, text: str) -> bool:
    """Whether `text` can still be completed into a sentence of the constraint's grammar."""
    grammars = Grammars(Tokenizer.from_pretrained(model_dir), 300, [1, 3])
    matcher = grammars.matcher(constraint)
    return matcher.consume_tokens(grammars.ll_tokenizer.tokenize_str(text)) \
        and not matcher.is_error()


def _schema_format(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_twenty_schemas_every_stopped_answer_validates(target) -> None:  # type: ignore[no-untyped-def]
    client, model, path = target
    stopped = cut = 0
    for i, schema in enumerate(SCHEMAS):
        for seed in (0, 1):
            response = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0,
                seed=seed, response_format=_schema_format(schema))  # type: ignore[arg-type]
            choice = response.choices[0]
            text = choice.message.content or ""
            if choice.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(text), schema)
            else:
                assert choice.finish_reason == "length", (i, choice)
                cut += 1
                assert is_grammar_prefix(path, StructuredOutput.json_schema(schema), text), \
                    (i, text)
    print(f"\n{model}: {stopped} answers stopped and validated, {cut} cut by max_tokens "
          "and a valid grammar prefix")
    assert stopped >= 30  # the bounded schemas end well within the budget


def test_an_answer_cut_by_max_tokens_is_a_prefix_of_the_grammar(target) -> None:  # type: ignore[no-untyped-def]
    client, model, path = target
    schema = SCHEMAS[-1]
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=9, temperature=0.0,
        response_format=_schema_format(schema))  # type: ignore[arg-type]
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    text = choice.message.content or ""
    assert text.startswith('{"') and is_grammar_prefix(
        path, StructuredOutput.json_schema(schema), text)
    assert not is_grammar_prefix(path, StructuredOutput.json_schema(schema), text + "]")


def test_vllm_extras_and_json_object_streamed_and_not(target) -> None:  # type: ignore[no-untyped-def]
    client, model, _ = target
    choices = ["alpha", "beta", "gamma delta"]
    extras = [({"guided_choice": choices}, lambda t: t in choices),
              ({"guided_regex": r"[a-c]{2}-[0-9]{3}"},
               lambda t: len(t) == 6 and t[2] == "-" and t[3:].isdigit()),
              ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
              ({"guided_json": SCHEMAS[1]},
               lambda t: json.loads(t)["color"] in ("red", "green", "blue"))]
    for extra, check in extras:
        whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40,
                                               temperature=1.0, seed=3, extra_body=extra)
        assert whole.choices[0].finish_reason == "stop" and check(whole.choices[0].message.content)
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40,
                                                temperature=1.0, seed=3, extra_body=extra,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == whole.choices[0].message.content, extra
    completion = client.completions.create(model=model, prompt="JSON:", max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"guided_json": SCHEMAS[0]})
    if completion.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[0])
    obj = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0.0, response_format={"type": "json_object"})
    text = obj.choices[0].message.content or ""
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_constrained_and_free_requests_share_a_batch(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0,
                                timeout=120.0)
    prompts = [f"Tell me about block {i}" for i in range(4)]

    async def free(prompt: str) -> str:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                            temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def constrained(i: int) -> tuple[str, str | None]:
        r = await client.completions.create(model=model, prompt=prompts[i % 4], max_tokens=120,
                                            temperature=1.0, seed=i,
                                            extra_body={"guided_json": SCHEMAS[i]})
        return r.choices[0].text, r.choices[0].finish_reason

    async def run() -> tuple[list[str], list[str], list[tuple[str, str | None]]]:
        alone = [await free(p) for p in prompts]
        mixed = await asyncio.gather(*[free(p) for p in prompts],
                                     *[constrained(i) for i in range(8)])
        return alone, list(mixed[:4]), list(mixed[4:])  # type: ignore[arg-type]

    model = openai.OpenAI(base_url=f"{server.url}/v1", api_key="d", max_retries=0
                          ).models.list().data[0].id
    alone, together, shaped = asyncio.run(run())
    assert together == alone  # the masks never touch an unconstrained row
    for i, (text, reason) in enumerate(shaped):
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.parametrize(("extra", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
     "dependentSchemas"),
    ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema needs"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar is not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "not several (guided_regex, guided_choice)"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos cannot be combined"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "llguidance"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "(unclosed"}, "regex constraint is not supported"),
])
def test_unsupported_constraints_are_a_400_naming_them(server: ServerProcess, extra, needle
                                                       ) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=client.models.list().data[0].id,
                                       messages=MESSAGES, max_tokens=8, extra_body=extra)
    assert needle in info.value.message
