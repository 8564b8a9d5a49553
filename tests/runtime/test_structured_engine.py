"""Structured output through the whole engine on the tiny random checkpoints: the grammar mask
makes random weights write valid JSON, greedy and sampled, beside unconstrained rows of the same
step, and through preemption by recompute."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.engine import SamplingParams, StructuredOutput
from tests.runtime.conftest import PARITY_ARCHS, make_engine, random_prompt, run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(params=PARITY_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def _params(temperature: float, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=temperature, seed=seed,
                          structured=StructuredOutput.json_schema(SCHEMA), **kw)


def test_constrained_rows_validate_and_unconstrained_rows_are_untouched(arch, checkpoints):
    path = checkpoints[arch]
    prompts = {f"r{i}": random_prompt(5 + i, seed=300 + i) for i in range(4)}
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = make_engine(path)
    for rid, prompt in prompts.items():
        alone.add_request(rid, prompt, free)
    expected = {rid: o.outputs[0].token_ids for rid, o in run_to_completion(alone).items()}

    engine = make_engine(path)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, free)
        engine.add_request(f"{rid}-greedy", prompt, _params(0.0))
        engine.add_request(f"{rid}-random", prompt, _params(1.0, seed=5))
    done = run_to_completion(engine)
    for rid in prompts:
        assert done[rid].outputs[0].token_ids == expected[rid], rid
        for kind in ("greedy", "random"):
            out = done[f"{rid}-{kind}"].outputs[0]
            assert out.finish_reason.value == "stop", (rid, kind, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine.grammars is not None and engine.grammars.num_compiled == 1  # cached


def test_preemption_by_recompute_keeps_the_matcher_in_step(arch, checkpoints):
    engine = make_engine(checkpoints[arch], num_kv_blocks=24)
    for i in range(4):
        engine.add_request(f"p{i}", random_prompt(9 + 3 * i, seed=400 + i),
                           _params(1.0, seed=i))
    done = run_to_completion(engine)
    assert engine.core.scheduler.num_preemptions > 0
    for output in done.values():
        out = output.outputs[0]
        assert out.finish_reason.value == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_and_json_object(checkpoints):
    engine = make_engine(checkpoints["llama_gqa"])
    prompt = random_prompt(6, seed=1)
    engine.add_request("re", prompt, SamplingParams(
        max_tokens=30, temperature=1.0, seed=3,
        structured=StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,4}")))
    engine.add_request("choice", prompt, SamplingParams(
        max_tokens=30, temperature=1.0, seed=4,
        structured=StructuredOutput.choice(["red", "green", 'say "hi"'])))
    engine.add_request("obj", prompt, SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput.json_object()))
    done = run_to_completion(engine)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", done["re"].outputs[0].text)
    assert done["choice"].outputs[0].text in ("red", "green", 'say "hi"')
    obj = done["obj"].outputs[0]
    if obj.finish_reason.value == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_an_unsupported_schema_is_refused_naming_the_keyword(checkpoints):
    engine = make_engine(checkpoints["llama_gqa"])
    bad = StructuredOutput.json_schema({"type": "object", "dependentSchemas": {"a": {}}})
    with pytest.raises(ValueError, match="dependentSchemas"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured=bad))
    assert not engine.has_unfinished
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=bad, ignore_eos=True)
