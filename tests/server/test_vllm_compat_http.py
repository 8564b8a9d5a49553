"""kvserve started with a vLLM launch line, answering vLLM's requests in vLLM's shapes.

The recorded answers (tests/data/vllm_responses, made by record.py there with vLLM 0.32's CPU
build on the same checkpoint and launch line) are compared field by field: every key vLLM
returns must be there with a value of the same JSON type (a vLLM null accepts anything;
kvserve may add keys). Values are not compared, except the prompt logprobs of `echo`, which
two independent implementations must agree on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.harness import ServerProcess
from tests.server.vllm_key_sets import assert_same_key_sets, body_key_sets, stream_key_sets
from tests.server.vllm_requests import (
    CASES,
    MODEL,
    PROMPT,
    Case,
    launch_line,
    send,
    write_chat_template,
    write_checkpoint,
)

RECORDED = Path(__file__).parent.parent / "data" / "vllm_responses"
MAPS = {"top_logprobs"}  # their entries map token text (any key) to a logprob
ID_MAPS = {"prompt_logprobs"}  # their entries map token ids (any key) to a logprob object


def assert_same_shape(ours: Any, theirs: Any, path: str = "$") -> None:
    """Every key of `theirs` is in `ours` with a value of the same JSON type, recursively."""
    if theirs is None:
        return
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{path}: vLLM has an object, kvserve {ours!r}"
        for key, value in theirs.items():
            assert key in ours, f"{path}.{key}: vLLM returns it, kvserve does not"
            if key in MAPS:
                _assert_maps(ours[key], value, f"{path}.{key}")
            elif key in ID_MAPS and value is not None:
                _assert_id_maps(ours[key], value, f"{path}.{key}")
            else:
                assert_same_shape(ours[key], value, f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list), f"{path}: vLLM has a list, kvserve {ours!r}"
        assert len(ours) == len(theirs), f"{path}: {len(ours)} items, vLLM {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same_shape(a, b, f"{path}[{i}]")
    elif isinstance(theirs, bool):
        assert isinstance(ours, bool), f"{path}: vLLM has a bool, kvserve {ours!r}"
    elif isinstance(theirs, int | float):
        assert isinstance(ours, int | float) and not isinstance(ours, bool), \
            f"{path}: vLLM has a number, kvserve {ours!r}"
        if isinstance(theirs, int):
            assert isinstance(ours, int), f"{path}: vLLM has an integer, kvserve {ours!r}"
    else:
        assert type(ours) is type(theirs), f"{path}: vLLM has {theirs!r}, kvserve {ours!r}"


def _assert_maps(ours: Any, theirs: Any, path: str) -> None:
    assert isinstance(ours, list) and len(ours) == len(theirs), path
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if b is None:
            assert a is None, f"{path}[{i}]: vLLM has null, kvserve {a!r}"
            continue
        assert isinstance(a, dict) and a, f"{path}[{i}]: vLLM has a map, kvserve {a!r}"
        assert all(isinstance(k, str) and isinstance(v, float) for k, v in a.items()), path


def _assert_id_maps(ours: Any, theirs: Any, path: str) -> None:
    assert isinstance(ours, list) and len(ours) == len(theirs), path
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if b is None:
            assert a is None, f"{path}[{i}]: vLLM has null, kvserve {a!r}"
            continue
        assert isinstance(a, dict) and a, f"{path}[{i}]: vLLM has a map, kvserve {a!r}"
        sample = next(iter(b.values()))
        for key, value in a.items():
            assert key.isdigit(), f"{path}[{i}]: key {key!r} is not a token id"
            assert_same_shape(value, sample, f"{path}[{i}][{key}]")


def _kind(chunk: Any) -> str:
    if not isinstance(chunk, dict):
        return "done"
    if not chunk["choices"]:
        return "usage"
    return "finish" if chunk["choices"][0]["finish_reason"] else "content"


@pytest.fixture(scope="module")
def vllm_style_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """kvserve started with `launch_line`, vLLM's own arguments, unchanged."""
    root = tmp_path_factory.mktemp("vllm-style")
    model_dir = write_checkpoint(root / "tiny-llama")
    template = write_chat_template(model_dir, root / "template.jinja")
    server = ServerProcess(model_dir, root, command=launch_line(model_dir, template))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_response_shapes_match_vllm(vllm_style_server: ServerProcess, case: Case) -> None:
    theirs = json.loads((RECORDED / f"{case.name}.json").read_text(encoding="utf-8"))
    with httpx.Client(base_url=vllm_style_server.url, timeout=60) as client:
        ours = send(client, case)
    assert ours["status"] == theirs["status"] == 200, ours
    assert ours["content_type"].split(";")[0] == theirs["content_type"].split(";")[0]
    if case.stream:
        kinds = [_kind(c) for c in ours["chunks"]]
        assert kinds[-2:] == ["usage", "done"] and "finish" in kinds, kinds
        recorded = {_kind(c): c for c in theirs["chunks"]}
        for i, chunk in enumerate(ours["chunks"]):
            assert_same_shape(chunk, recorded[_kind(chunk)], f"chunk[{i}]")
    else:
        assert_same_shape(ours["body"], theirs["body"])


GENERATING = [c for c in CASES if c.path in ("/v1/completions", "/v1/chat/completions")]
ANSWER = {"type": "object", "properties": {"word": {"enum": ["yes", "no"]}},
          "required": ["word"]}


def _key_sets_agree(server: ServerProcess, case: Case, extra: dict[str, Any]) -> None:
    theirs = json.loads((RECORDED / f"{case.name}.json").read_text(encoding="utf-8"))
    asked = Case(case.name, case.method, case.path, (case.body or {}) | extra, case.stream)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        ours = send(client, asked)
    assert ours["status"] == 200, ours
    if case.stream:
        compared = assert_same_key_sets(stream_key_sets(ours["chunks"][:-1]),
                                        stream_key_sets(theirs["chunks"][:-1]), case.name)
    else:
        compared = assert_same_key_sets(body_key_sets(ours["body"]),
                                        body_key_sets(theirs["body"]), case.name)
    assert compared >= 3, compared


@pytest.mark.parametrize("case", GENERATING, ids=[c.name for c in GENERATING])
def test_key_sets_match_vllm(vllm_style_server: ServerProcess, case: Case) -> None:
    """The same keys as vLLM's, object by object (its nulls included), chunk kind by kind."""
    _key_sets_agree(vllm_style_server, case, {})


@pytest.mark.parametrize("case", [c for c in GENERATING if not c.name.startswith("completion_")
                                  or c.name == "completion_stream"],
                         ids=lambda c: c.name)
def test_key_sets_with_json_schema_match_vllm(vllm_style_server: ServerProcess,
                                              case: Case) -> None:
    """A constrained answer has the keys of a free one (vLLM's shapes do not change with
    structured output: its answers to the json_schema chat requests, recorded beside the
    tool calls, have the keys of its plain ones)."""
    _key_sets_agree(vllm_style_server, case, {"structured_outputs": {"json": ANSWER}})


def test_echo_prompt_logprobs_agree_with_vllm(vllm_style_server: ServerProcess) -> None:
    """The prompt's logprobs (echo) are the very ones vLLM computed on the same weights."""
    case = next(c for c in CASES if c.name == "completion_echo_loglikelihood")
    theirs = json.loads((RECORDED / f"{case.name}.json").read_text(encoding="utf-8"))
    with httpx.Client(base_url=vllm_style_server.url, timeout=60) as client:
        ours = send(client, case)["body"]["choices"][0]
    want = theirs["body"]["choices"][0]
    assert ours["text"] == want["text"] == PROMPT
    assert ours["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert ours["logprobs"]["text_offset"] == want["logprobs"]["text_offset"]
    got, ref = ours["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
    assert got[0] is None and ref[0] is None
    assert got[1:] == pytest.approx(ref[1:], abs=1e-3)
    # vLLM's prompt_logprobs: the prompt token's rank among all tokens, as vLLM counts it.
    tokenize = next(c for c in CASES if c.name == "tokenize_prompt")
    with httpx.Client(base_url=vllm_style_server.url, timeout=60) as client:
        ids = send(client, tokenize)["body"]["tokens"]
    ours_ranks = [None if e is None else e[str(t)]["rank"]
                  for e, t in zip(ours["prompt_logprobs"], ids, strict=True)]
    want_ranks = [None if e is None else e[str(t)]["rank"]
                  for e, t in zip(want["prompt_logprobs"], ids, strict=True)]
    assert ours_ranks == want_ranks


def test_openai_client_echo_and_stop_reason(vllm_style_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{vllm_style_server.url}/v1", api_key="none",
                           max_retries=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=0, temperature=0)
    choice = echoed.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == echoed.usage.prompt_tokens
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0  # prompt logprobs: no hit
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                        temperature=0, stop=["p"],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == "p"
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].model_extra["stop_reason"] is None


def test_echo_streamed_starts_with_the_prompt(vllm_style_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{vllm_style_server.url}/v1", api_key="none",
                           max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True,
                                      temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            echo=True, temperature=0, logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_utility_routes(vllm_style_server: ServerProcess) -> None:
    with httpx.Client(base_url=vllm_style_server.url, timeout=30) as client:
        ids = client.post("/tokenize", json={"prompt": PROMPT}).json()
        assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 256
        no_bos = client.post("/tokenize", json={"prompt": PROMPT,
                                                "add_special_tokens": False}).json()
        assert no_bos["tokens"] == ids["tokens"][1:]
        back = client.post("/detokenize", json={"tokens": no_bos["tokens"]}).json()
        assert back == {"prompt": PROMPT}
        strs = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
        assert len(strs.json()["token_strs"]) == ids["count"]
        both = client.post("/tokenize", json={"prompt": "x", "messages": []})
        assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
        bad = client.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        wrong = client.post("/tokenize", json={"model": "other", "prompt": "x"})
        assert wrong.status_code == 404
        models = client.get("/v1/models").json()["data"][0]
        assert models["created"] > 0 and models["permission"] and "parent" in models


def test_probes_need_no_key_and_tokenize_does(auth_server: ServerProcess) -> None:
    """/ping and /version answer health probes without a key; /tokenize needs it (vLLM's)."""
    with httpx.Client(base_url=auth_server.url, timeout=30) as client:
        assert client.get("/ping").status_code == 200
        assert client.post("/ping").status_code == 200
        assert client.get("/version").json()["version"]
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        keyed = client.post("/tokenize", json={"prompt": "x"}, headers=auth_server.headers)
        assert keyed.status_code == 200
