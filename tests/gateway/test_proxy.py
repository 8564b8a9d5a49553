"""The gateway as a proxy, through real `kvserve serve` workers on loopback and the official
`openai` client: answers equal the worker's own, tenants are isolated, prefixes stay put."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.fleet.text_capacity import DEFAULT_SAMPLE_EVERY, MIN_SAMPLES
from tests.gateway.conftest import SALT_SECRET, MakeClient
from tests.gateway.processes import Process, running_gateway, wait_until

RUN = {"ignore_eos": True}  # random weights: never let an early EOS shorten a test
MESSAGES = [{"role": "user", "content": "Summarise the quarterly filing."}]
# One full 256-character block of the gateway's text key (so prefix_hash has a prefix to hash),
# about 205 tokens of the demo tokenizer: room left for a suffix and a few output tokens.
LONG_PREFIX = ("The analyst reviews quarterly filings and flags the risks she finds. " * 4)[:256]


def _requests_by_worker(gateway: Process) -> dict[str, int]:
    return {w["url"]: w["requests"] for w in gateway.get("/workers").json()["workers"]}


def _affinity_by_worker(gateway: Process) -> dict[str, float]:
    """kvserve:gateway_requests_total{branch="affinity"} per worker label."""
    return {labels["worker"]: value for name, labels, value in gateway.metrics().samples
            if name == "kvserve:gateway_requests_total" and labels.get("branch") == "affinity"}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {url: after[url] - before[url] for url in after if after[url] != before[url]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_the_workers_answer(gateway: Process, fleet: list[Process],
                                              make_client: MakeClient, model_name: str,
                                              stream: bool) -> None:
    args = {"model": model_name, "prompt": "Hello there, tell me", "max_tokens": 12,
            "temperature": 0.0, "extra_body": RUN}
    direct = make_client(fleet[0].url).completions.create(**args)  # type: ignore[call-overload]
    request_id = f"gw-completion-{stream}"
    client = make_client(gateway.url)
    if not stream:
        raw = client.completions.with_raw_response.create(  # type: ignore[call-overload]
            **args, extra_headers={"X-Request-Id": request_id})
        assert raw.headers["x-request-id"] == request_id
        answer = raw.parse()
        assert answer.id == f"cmpl-{request_id}"  # the worker saw the caller's request id
        assert answer.choices[0].text == direct.choices[0].text
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 12
        assert answer.usage.prompt_tokens == direct.usage.prompt_tokens
        return
    chunks = list(client.completions.create(  # type: ignore[call-overload]
        **args, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id}))
    assert {c.id for c in chunks} == {f"cmpl-{request_id}"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_the_workers_answer(gateway: Process, fleet: list[Process],
                                        make_client: MakeClient, model_name: str,
                                        stream: bool) -> None:
    args = {"model": model_name, "messages": MESSAGES, "max_tokens": 10, "temperature": 0.0,
            "extra_body": RUN}
    direct = make_client(fleet[1].url).chat.completions.create(**args)  # type: ignore[call-overload]
    client = make_client(gateway.url)
    if not stream:
        answer = client.chat.completions.create(**args)  # type: ignore[call-overload]
        assert answer.choices[0].message.content == direct.choices[0].message.content
        assert answer.choices[0].message.role == "assistant"
        assert answer.usage.completion_tokens == 10
        assert answer.usage.prompt_tokens == direct.usage.prompt_tokens
        return
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        **args, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "gw-chat-stream"}))
    assert {c.id for c in chunks} == {"chatcmpl-gw-chat-stream"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_tenants_are_isolated_and_client_salts_ignored(gateway: Process,
                                                       make_client: MakeClient,
                                                       model_name: str) -> None:
    client = make_client(gateway.url)
    prompt = LONG_PREFIX + " Tenant isolation."

    def cached(tenant: str, salt: str | None = None) -> tuple[int, dict[str, int]]:
        before = _requests_by_worker(gateway)
        extra = dict(RUN) | ({"cache_salt": salt} if salt is not None else {})
        answer = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                           extra_body=extra,
                                           extra_headers={"X-Tenant-Id": tenant})
        details = answer.usage.prompt_tokens_details
        assert details is not None
        return details.cached_tokens or 0, _delta(_requests_by_worker(gateway), before)

    first, a_worker = cached("a")
    assert first == 0
    assert cached("b")[0] == 0
    # The client's salt is replaced by tenant a's own, so a still hits its blocks.
    again, where = cached("a", salt="client-chosen-salt")
    assert again > 0 and where == a_worker
    # A tenant that forges tenant a's real salt gets its own salt instead: no hit, even on
    # a's worker (try tenants until one lands there: rendezvous order depends on the ports).
    a_salt = Tenancy(SALT_SECRET, trust_header=True).resolve({"x-tenant-id": "a"}).salt
    for i in range(16):
        hit, where = cached(f"forger-{i}", salt=a_salt)
        if where == a_worker:
            assert hit == 0
            break
    else:
        pytest.fail(f"no forger tenant was routed to {a_worker}")


def test_prefix_affinity_keeps_a_tenant_on_one_worker(gateway: Process, make_client: MakeClient,
                                                      model_name: str) -> None:
    client = make_client(gateway.url)
    before_requests = _requests_by_worker(gateway)
    before_affinity = _affinity_by_worker(gateway)
    hits = []
    for i in range(10):
        answer = client.completions.create(model=model_name, prompt=f"{LONG_PREFIX} Q{i}: why?",
                                           max_tokens=2, extra_body=RUN,
                                           extra_headers={"X-Tenant-Id": "affinity"})
        details = answer.usage.prompt_tokens_details
        hits.append(details.cached_tokens if details else None)
    moved = _delta(_requests_by_worker(gateway), before_requests)
    assert list(moved.values()) == [10], moved
    (worker,) = moved
    affinity = _affinity_by_worker(gateway)
    assert affinity[worker] - before_affinity.get(worker, 0.0) == 10, (affinity, before_affinity)
    assert all(h and h >= 192 for h in hits[1:]), hits  # the shared prefix stayed cached


MALFORMED = [
    ("/v1/completions", b"this is not json"),
    ("/v1/completions", b"[1, 2, 3]"),
    ("/v1/completions", b'{"max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": 42}'),
    ("/v1/completions", b'{"prompt": {"text": "hi"}}'),
    ("/v1/completions", b'{"prompt": [1, "two"]}'),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}'),
    ("/v1/completions", b"[" * 100_000),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}'),  # the worker's 400, passed on
    ("/v1/completions", b'{"prompt": "' + b"word " * 400 + b'"}'),  # longer than max_model_len
    ("/v1/chat/completions", b'{"messages": "hello"}'),
    ("/v1/chat/completions", b'{"messages": ["hello"]}'),
    ("/v1/chat/completions", b'{"model": "m"}'),
]


@pytest.mark.parametrize(("path", "body"), MALFORMED,
                         ids=[f"{i}-{p.rsplit('/', 1)[1]}" for i, (p, _) in enumerate(MALFORMED)])
def test_malformed_input_is_a_4xx_with_the_openai_error_shape(gateway: Process, path: str,
                                                              body: bytes) -> None:
    answer = httpx.post(f"{gateway.url}{path}", content=body, timeout=30.0,
                        headers={"Content-Type": "application/json"})
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


def test_after_bad_input_the_gateway_still_serves(gateway: Process, make_client: MakeClient,
                                                  model_name: str) -> None:
    client = make_client(gateway.url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt=42)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    good = client.completions.create(model=model_name, prompt="Still there?", max_tokens=3,
                                     extra_body=RUN)
    assert good.usage is not None and good.usage.completion_tokens == 3
    workers = gateway.get("/workers").json()["workers"]
    assert [w["in_flight"] for w in workers] == [0, 0]  # nothing leaked by the bad requests


def test_health_and_metrics(gateway: Process, make_client: MakeClient, model_name: str) -> None:
    health = gateway.get("/health")
    assert health.status_code == 200 and health.json()["healthy_workers"] == 2
    client = make_client(gateway.url)
    for _ in range(2):  # the second one hits the first one's blocks
        client.completions.create(model=model_name, prompt=LONG_PREFIX, max_tokens=1,
                                  extra_body=RUN)
    # The fleet hit rate comes from the workers' own counters, scraped every second.
    wait_until(lambda: gateway.metrics().value("kvserve:gateway_fleet_prefix_hit_rate") > 0,
               10.0, "a fleet prefix hit rate above 0")
    metrics = gateway.metrics()
    assert metrics.value("kvserve:gateway_requests_total") > 0
    assert metrics.value("kvserve:gateway_added_latency_seconds_count") > 0
    assert 0.0 < metrics.value("kvserve:gateway_fleet_prefix_hit_rate") <= 1.0


def test_workers_shows_each_workers_kv_capacity_from_its_own_metrics(
        gateway: Process, fleet: list[Process]) -> None:
    capacities = {}
    for worker in fleet:
        [labels] = [lab for name, lab, _ in worker.metrics().samples
                    if name == "vllm:cache_config_info"]
        capacities[worker.url] = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    shown = {w["url"]: w["kv_capacity_tokens"] for w in gateway.get("/workers").json()["workers"]}
    assert shown == capacities and min(shown.values()) > 0


def test_cache_aware_measures_characters_per_token_with_the_workers_tokenizer(
        fleet: list[Process], proc_logs: Path, make_client: MakeClient, model_name: str) -> None:
    """Text keys assume 4 characters a token; the gateway tokenizes prompts with the tokenizer
    the workers' /v1/models names, to scale their capacity to what text keys count: each of
    the first MIN_SAMPLES, then one in 32."""
    with running_gateway([w.url for w in fleet], proc_logs,
                         ["--policy", "cache_aware"]) as gateway:
        client = make_client(gateway.url)
        for i in range(DEFAULT_SAMPLE_EVERY):
            client.completions.create(model=model_name, prompt=f"{LONG_PREFIX} question {i}",
                                      max_tokens=1, extra_body=RUN)
        state = gateway.get("/workers").json()
    assert state["text_keys"]["tokenizer"] is True
    # the first MIN_SAMPLES prompts, then the 32nd
    assert state["text_keys"]["tokenized_samples"] == MIN_SAMPLES + 1
    assert all(w["kv_capacity_tokens"] > 0 for w in state["workers"])
