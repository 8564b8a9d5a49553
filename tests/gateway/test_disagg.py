"""Disaggregated prefill and decode over real sockets: a gateway, a `--role prefill` worker, a
`--role decode` worker, and a unified worker for reference. Greedy output through the split
fleet equals the unified worker's token for token; aborts at random points of the transfer (the
client leaving, the decode<->prefill connection cut at random byte offsets either way by a real
TCP proxy) leave nothing held on either worker; a corrupted frame fails the request cleanly."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import MakeClient
from tests.gateway.processes import Process, running_gateway, running_worker_set, wait_until
from tests.gateway.tcp_proxy import Cut, FaultyProxy, Flip, Stall

ADMIN = "disagg-admin-key"
COMMON = ("--admin-key", ADMIN, "--audit-interval-steps", "10")
ROLES = {
    "prefill": ("--role", "prefill", *COMMON),
    "decode": ("--role", "decode", "--kv-host-tier-bytes", str(1 << 21), *COMMON),
    "unified": COMMON,
}
PULL_FROM = "X-KVServe-Prefill-Url"
SYSTEM = "You are a terse assistant who answers in one line. "


@pytest.fixture(scope="module")
def workers(tiny_model: Path, proc_logs: Path) -> Iterator[dict[str, Process]]:
    with running_worker_set(tiny_model, proc_logs, list(ROLES.values())) as procs:
        yield dict(zip(ROLES, procs, strict=True))


@pytest.fixture(scope="module")
def split_gateway(workers: dict[str, Process], proc_logs: Path) -> Iterator[Process]:
    flags = ["--prefill-worker", workers["prefill"].url, "--decode-worker",
             workers["decode"].url, "--admin-key", ADMIN]
    with running_gateway([], proc_logs, flags, expect_healthy=2) as gw:
        yield gw


@pytest.fixture(scope="module")
def proxy(workers: dict[str, Process]) -> Iterator[FaultyProxy]:
    fp = FaultyProxy(workers["prefill"].port)
    yield fp
    fp.close()


def value(proc: Process, name: str, **labels: str) -> float:
    try:
        return proc.metrics().value(name, **labels)
    except KeyError:
        return 0.0


def complete(client: openai.OpenAI, model: str, prompt: str | list[int],
             max_tokens: int = 12) -> str:
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    return answer.choices[0].text


def pull(decode: Process, url: str, prompt: list[int], max_tokens: int = 4,
         timeout: float = 60.0, stream: bool = False) -> httpx.Response:
    """A request straight to the decode worker, naming `url` as its prefill worker."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    headers = {PULL_FROM: url, "X-KVServe-Admin-Key": ADMIN}
    return httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers,
                      timeout=timeout)


def assert_clean(proc: Process) -> None:
    """Drained, a clean audit, and nothing held: blocks, host slots, pins, imports."""
    def drained() -> bool:  # a pull the client left may still be winding down
        return all(value(proc, n) == 0 for n in ("kvserve:kv_held_blocks",
                                                 "vllm:num_requests_running",
                                                 "vllm:num_requests_waiting",
                                                 "kvserve:kv_host_pinned_slots",
                                                 "kvserve:kv_host_storing_slots"))
    wait_until(drained, 30.0, f"{proc.url} to drain")
    report = proc.get("/debug/kv", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert report["audit"]["ok"], report["audit"]
    assert report["audit"]["census"]["held"] == 0
    assert report["held_blocks_by_request"] == {}
    if report["host_tier"] is not None:
        census = report["host_tier"]["census"]
        assert census["num_storing"] == census["num_pinned"] == 0, census
    if report["kv_imports"] is not None:
        imports = report["kv_imports"]
        assert (imports["num_open"], imports["num_attached"], imports["num_pinned_slots"],
                imports["num_reserved_slots"]) == (0, 0, 0, 0), imports


def test_split_fleet_output_equals_unified_token_for_token(
        workers: dict[str, Process], split_gateway: Process, make_client: MakeClient,
        model_name: str) -> None:
    prompts = [SYSTEM + "What is the capital of France?",
               SYSTEM + "Name three prime numbers.",  # shares the system prompt's blocks
               "Hi",  # under one block: nothing to transfer
               "Tell me about the ocean and the tides, " * 4,
               SYSTEM * 3 + "Summarise the above."]
    unified = make_client(workers["unified"].url)
    split = make_client(split_gateway.url)
    decode, prefill = workers["decode"], workers["prefill"]
    for prompt in prompts:
        skipped_before = value(decode, "kvserve:kv_transfer_skipped_blocks_total")
        assert complete(split, model_name, prompt) == complete(unified, model_name, prompt)
        if prompt is prompts[1]:
            assert value(decode, "kvserve:kv_transfer_skipped_blocks_total") > skipped_before
    chat = [{"role": "user", "content": SYSTEM + "And now in a chat?"}]
    answers = [c.chat.completions.create(model=model_name, messages=chat, max_tokens=8,
                                         temperature=0.0).choices[0].message.content
               for c in (split, unified)]
    assert answers[0] == answers[1]
    streamed = "".join(chunk.choices[0].text for chunk in split.completions.create(
        model=model_name, prompt=prompts[3] + " once more", max_tokens=12, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == complete(unified, model_name, prompts[3] + " once more")

    received = value(decode, "kvserve:kv_transfer_blocks_received_total")
    assert received > 0
    assert value(prefill, "kvserve:kv_transfer_blocks_sent_total") == received
    pulls = value(decode, "kvserve:kv_pull_seconds_count")
    assert pulls >= len(prompts) + 2
    assert 0 < value(decode, "kvserve:kv_transfer_seconds_count") < pulls  # "Hi": none
    listing = split_gateway.get("/workers").json()
    assert listing["mode"] == "disaggregated"
    assert {w["url"]: w["role"] for w in listing["workers"]} == {prefill.url: "prefill",
                                                                 decode.url: "decode"}
    assert value(split_gateway, "kvserve:gateway_worker_role", worker=prefill.url,
                 role="prefill") == 1
    for proc in (prefill, decode):
        assert_clean(proc)


def test_a_client_cannot_name_a_prefill_worker(workers: dict[str, Process]) -> None:
    decode = workers["decode"]
    body = {"prompt": "hello there", "max_tokens": 2}
    answer = httpx.post(f"{decode.url}/v1/completions", json=body,
                        headers={PULL_FROM: "http://169.254.169.254"}, timeout=30)
    assert answer.status_code == 403 and "admin key" in answer.json()["error"]["message"]
    answer = httpx.post(f"{workers['unified'].url}/v1/completions", json=body,
                        headers={PULL_FROM: workers["prefill"].url}, timeout=30)
    assert answer.status_code == 400 and "--role decode" in answer.json()["error"]["message"]


def test_aborts_at_random_points_of_the_transfer_leave_nothing_held(
        workers: dict[str, Process], proxy: FaultyProxy) -> None:
    rng = random.Random(8)
    decode, prefill = workers["decode"], workers["prefill"]
    failures_before = value(decode, "kvserve:kv_transfer_failures_total")
    outcomes: dict[str, int] = {}
    for i in range(36):
        prompt = [rng.randint(3, 299) for _ in range(rng.randint(40, 200))]
        num_blocks = (len(prompt) - 1) // 16
        kind = ("client", "cut_response", "cut_request")[i % 3]
        if kind == "cut_response":
            proxy.arm(Cut(rng.randint(0, num_blocks * 8270 + 200)))
        elif kind == "cut_request":
            proxy.arm(Cut(rng.randint(0, 150 + 4 * len(prompt)), upstream=True))
        else:  # the client leaves while the frames are on the way (a stalled network)
            proxy.arm(Stall(rng.randint(0, num_blocks * 8270), 0.5))
        try:
            answer = pull(decode, proxy.url, prompt, stream=bool(i % 2),
                          timeout=rng.uniform(0.05, 0.4) if kind == "client" else 60.0)
        except httpx.TimeoutException:
            outcomes["client_left"] = outcomes.get("client_left", 0) + 1
            continue
        if answer.status_code == 200:
            outcomes["ok"] = outcomes.get("ok", 0) + 1
            continue
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert f"prefill worker {proxy.url}" in message, message
        outcomes["failed"] = outcomes.get("failed", 0) + 1
    proxy.arm(None)
    assert outcomes.get("failed", 0) >= 6 and outcomes.get("client_left", 0) >= 6, outcomes
    assert value(decode, "kvserve:kv_transfer_failures_total") - failures_before >= 6
    for proc in (decode, prefill):
        assert_clean(proc)
    prompt = [rng.randint(3, 299) for _ in range(120)]  # and the pair still works
    answer = pull(decode, proxy.url, prompt, max_tokens=6)
    assert answer.status_code == 200
    reference = httpx.post(f"{workers['unified'].url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert answer.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_a_corrupted_frame_fails_the_request_cleanly(
        workers: dict[str, Process], proxy: FaultyProxy) -> None:
    decode, prefill = workers["decode"], workers["prefill"]
    prompt = [7 + (i * 13) % 280 for i in range(150)]
    before = value(decode, "kvserve:kv_transfer_checksum_failures_total")
    fired = proxy.num_faults_fired
    proxy.arm(Flip(offset=1000))
    answer = pull(decode, proxy.url, prompt)
    assert proxy.num_faults_fired == fired + 1
    assert answer.status_code == 502
    assert "checksum mismatch" in answer.json()["error"]["message"]
    assert value(decode, "kvserve:kv_transfer_checksum_failures_total") == before + 1
    for proc in (decode, prefill):
        assert_clean(proc)
    answer = pull(decode, proxy.url, prompt, max_tokens=6)
    assert answer.status_code == 200
    reference = httpx.post(f"{workers['unified'].url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert answer.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
