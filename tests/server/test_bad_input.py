"""Bad requests: each gets its 4xx in OpenAI's error shape, and the worker keeps serving."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.server.harness import ADMIN_KEY, ServerProcess

COMPLETE = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
JSON_HEADERS = {"content-type": "application/json"}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    """One bad request: `body` is a dict (sent as JSON), raw bytes, or None (no body)."""

    id: str
    status: int
    body: dict[str, Any] | bytes | None = None
    path: str = COMPLETE
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    param: str | None = None  # the field the error must name, when it names one
    says: str | None = None  # a fragment the message must contain
    on_auth_server: bool = False


def completion(**fields: Any) -> dict[str, Any]:
    return {**GOOD, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {**GOOD_CHAT, **fields}


CASES = [
    # not a JSON object
    Case("malformed-json", 400, b'{"prompt": "Hello", '),
    Case("body-is-array", 400, b"[1, 2, 3]"),
    Case("body-is-string", 400, b'"Hello"'),
    Case("empty-body", 400, b""),
    Case("invalid-utf8", 400, b'{"prompt": "\xff\xfe\xc3(", "max_tokens": 2}'),
    Case("lone-surrogate-prompt", 400, b'{"prompt": "a\\ud800b", "max_tokens": 2}',
         says="Unicode"),
    Case("lone-surrogate-chat", 400,
         b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
         path=CHAT, says="Unicode"),
    Case("missing-prompt", 400, {"max_tokens": 2}, param="prompt"),
    # wrong types
    Case("max-tokens-string", 400, completion(max_tokens="ten"), param="max_tokens"),
    Case("temperature-string", 400, completion(temperature="hot"), param="temperature"),
    Case("n-zero", 400, completion(n=0), param="n"),
    Case("n-negative", 400, completion(n=-1), param="n"),
    Case("n-huge", 400, completion(n=10**24), param="n"),
    Case("seed-beyond-64-bit", 400, completion(temperature=1.0, seed=2**70), param="seed"),
    Case("prompt-mixed-list", 400, completion(prompt=[1, "a"])),
    Case("messages-not-list", 400, {"messages": "Hi"}, path=CHAT, param="messages"),
    Case("messages-empty", 400, {"messages": []}, path=CHAT, param="messages"),
    Case("role-unknown", 400, chat(messages=[{"role": "wizard", "content": "x"}]), path=CHAT,
         says="role"),
    Case("content-number", 400, chat(messages=[{"role": "user", "content": 5}]), path=CHAT,
         says="content"),
    Case("stream-options-not-bool", 400, completion(stream_options={"include_usage": "x"})),
    # out of range
    Case("temperature-5000", 400, completion(temperature=5000), says="temperature"),
    Case("temperature-nan", 400, b'{"prompt": "Hello", "temperature": NaN}',
         says="temperature"),
    Case("top-p-zero", 400, completion(top_p=0), says="top_p"),
    Case("top-p-1.5", 400, completion(top_p=1.5), says="top_p"),
    Case("logprobs-50", 400, completion(logprobs=50), param="logprobs"),
    Case("top-logprobs-50", 400, chat(logprobs=True, top_logprobs=50), path=CHAT,
         param="top_logprobs"),
    Case("top-k-negative", 400, completion(top_k=-5), says="top_k"),
    Case("presence-penalty-3", 400, completion(presence_penalty=3), says="presence_penalty"),
    Case("repetition-penalty-0", 400, completion(repetition_penalty=0),
         param="repetition_penalty"),
    Case("min-tokens-over-max", 400, completion(min_tokens=5), says="min_tokens"),
    Case("max-tokens-zero", 400, completion(max_tokens=0), says="max_tokens"),
    Case("chat-max-completion-tokens-zero", 400, chat(max_tokens=None, max_completion_tokens=0),
         path=CHAT, says="max_tokens"),
    # prompts the engine can never run
    Case("prompt-too-long", 400, completion(prompt="word " * 400), says="max_model_len 256"),
    Case("chat-too-long", 400, chat(messages=[{"role": "user", "content": "word " * 400}]),
         path=CHAT, says="max_model_len 256"),
    Case("stream-prompt-too-long", 400, completion(prompt="word " * 400, stream=True),
         says="max_model_len 256"),
    Case("token-id-out-of-vocab", 400, completion(prompt=[1, 2, 99999]), says="token ids"),
    Case("token-id-negative", 400, completion(prompt=[[5, -1]]), says="token ids"),
    Case("stream-token-id-out-of-vocab", 400, completion(prompt=[300], stream=True),
         says="token ids"),
    Case("empty-prompt-list", 400, completion(prompt=[]), says="empty"),
    Case("empty-token-ids", 400, completion(prompt=[[]]), says="empty"),
    Case("empty-stop-string", 400, completion(stop=""), says="stop"),
    Case("empty-stop-in-list", 400, completion(stop=["x", ""]), says="stop"),
    Case("too-many-stops", 400, completion(stop=[str(i) for i in range(17)]), param="stop"),
    # beyond the context, as vLLM's server refuses it (it once ran to max_model_len)
    Case("huge-max-tokens", 400, completion(max_tokens=10**30), says="maximum context length"),
    # unsupported
    Case("suffix", 400, completion(suffix="!"), param="suffix"),
    Case("max-tokens-zero-without-echo", 400, completion(max_tokens=0), says="max_tokens"),
    Case("best-of", 400, completion(n=1, best_of=3), param="best_of"),
    # wrong model, route, method, size
    Case("unknown-model", 404, completion(model="gpt-4"), param="model", says="gpt-4"),
    Case("stream-unknown-model", 404, completion(model="gpt-4", stream=True), param="model"),
    Case("chat-unknown-model", 404, chat(model="gpt-4"), path=CHAT, param="model"),
    Case("get-completions", 405, None, method="GET"),
    Case("delete-chat", 405, None, path=CHAT, method="DELETE"),
    Case("post-models", 405, {}, path="/v1/models"),
    Case("unknown-route", 404, GOOD, path="/v1/embeddingz"),
    Case("oversized-body", 413, completion(prompt="a" * (9 * MiB)), says="exceeds"),
    # API key (on a server started with --api-key)
    Case("missing-api-key", 401, GOOD, on_auth_server=True),
    Case("wrong-api-key", 401, GOOD, headers={"Authorization": "Bearer nope"},
         on_auth_server=True),
    Case("not-bearer", 401, GOOD, headers={"Authorization": API_KEY}, on_auth_server=True),
    Case("models-without-key", 401, None, path="/v1/models", method="GET",
         on_auth_server=True),
    Case("tokenize-without-key", 401, {"prompt": "x"}, path="/tokenize", on_auth_server=True),
    Case("detokenize-without-key", 401, {"tokens": [5]}, path="/detokenize",
         on_auth_server=True),
    Case("chat-without-key", 401, GOOD_CHAT, path=CHAT, on_auth_server=True),
    Case("debug-kv-without-key", 401, None, path="/debug/kv", method="GET",
         on_auth_server=True),
]


def _send(http: httpx.Client, case: Case, headers: dict[str, str]) -> httpx.Response:
    content = case.body if isinstance(case.body, bytes) else (
        None if case.body is None else json.dumps(case.body).encode())
    if content is not None:
        headers = {**JSON_HEADERS, **headers}
    return http.request(case.method, case.path, content=content, headers=headers)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """`response` is `status` with {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def assert_serves(http: httpx.Client, headers: dict[str, str]) -> None:
    response = http.post(COMPLETE, json=GOOD, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_a_4xx_and_the_server_keeps_serving(
        case: Case, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(
        "auth_server" if case.on_auth_server else "server")
    good_headers = {"Authorization": f"Bearer {API_KEY}"} if case.on_auth_server else {}
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        # the auth cases bring their own (missing or wrong) key
        headers = case.headers if case.on_auth_server else {**good_headers, **case.headers}
        error = assert_openai_error(_send(http, case, headers), case.status)
        if case.param is not None:
            assert error["param"] == case.param, error
        if case.says is not None:
            assert case.says in error["message"], error
        assert_serves(http, good_headers)
    assert server.proc.poll() is None, server.log()


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 25


def test_right_api_key_works_and_health_metrics_stay_open(auth_server: ServerProcess) -> None:
    with httpx.Client(base_url=auth_server.url, timeout=60.0) as http:
        key = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/v1/models", headers=key).status_code == 200
        chat_response = http.post(CHAT, json=GOOD_CHAT, headers=key)
        assert chat_response.status_code == 200, chat_response.text
        # The API key is every client's: it never opens the admin routes.
        assert_openai_error(http.get("/debug/kv", headers=key), 401)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert http.get("/debug/kv", headers=admin).json()["audit"]["ok"] is True
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        error = assert_openai_error(http.get("/v1/models"), 401)
        assert error["type"] == "authentication_error"


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-50},  # rounds to 0 in float32: was a division by zero
    {"temperature": 1.0, "top_p": 1e-50},  # rounds to 0 in float32: dropped every token
    {"temperature": 1.0, "seed": -(2**63), "n": 3},
    {"temperature": 1.0, "seed": 2**63 - 1, "n": 3},
    {"temperature": 1.0, "top_k": 10**30},
], ids=["tiny-temperature", "tiny-top-p", "min-seed", "max-seed", "huge-top-k"])
def test_extreme_but_valid_values_are_served(server: ServerProcess,
                                             fields: dict[str, Any]) -> None:
    """Values at the edges of the ranges once killed the engine loop (every later request got
    a 503); now they are served, and so is the next request."""
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        response = http.post(COMPLETE, json=completion(**fields))
        assert response.status_code == 200, response.text
        assert_serves(http, {})


def test_no_request_got_a_500(server: ServerProcess) -> None:
    """Every bad request above was refused at the boundary: nothing reached the 500 path."""
    log = server.log()
    assert "internal error" not in log and "Traceback" not in log, log
    assert server.metrics().value("kvserve:engine_up") == 1.0
