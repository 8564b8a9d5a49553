"""`precise`'s keys end to end: the gateway keys a prompt with the workers' own tokenizer
exactly as the worker hashes its blocks (read from the worker's `/kv/events`, kept for external
readers and these tests); the gateway follows the events over ZMQ (test_zmq_events_proxy.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from kvserve.gateway.core.prefix import engine_block_hashes
from kvserve.gateway.core.route_key import route_request_for
from kvserve.gateway.core.token_keys import TokenKeyer
from tests.gateway.processes import ADMIN_KEY, Process

PROMPT = "The compliance checker reads every clause of the contract and flags the risky ones. " * 2
RUN = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def stored_hashes(worker: Process) -> set[str]:
    page = worker.get("/kv/events", params={"after": 0, "limit": 65536}).json()
    return {h for e in page["events"] if e["type"] == "stored" for h in e["block_hashes"]}


def test_the_gateway_keys_a_prompt_exactly_as_the_worker_hashes_it(
        fleet: list[Process], tiny_model: Path, model_name: str) -> None:
    worker = fleet[0]
    body = {"model": model_name, "prompt": PROMPT, "cache_salt": "exact-salt", **RUN}
    httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).raise_for_status()
    ids = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(PROMPT).ids
    expected = engine_block_hashes(ids, 16, "exact-salt", model_name)
    assert len(expected) >= 4
    assert {h.hex() for h in expected} <= stored_hashes(worker)
    keyed = route_request_for("/v1/completions", body, "exact-salt", TokenKeyer(tiny_model))
    assert keyed.prefix_hashes == expected
    assert worker.get("/v1/models").json()["data"][0]["root"] == str(tiny_model)


def test_the_gateway_keys_a_conversation_exactly_as_the_worker_caches_it(
        fleet: list[Process], tiny_model: Path, model_name: str) -> None:
    """Chat template, tools and content parts rendered in the gateway as in the worker."""
    worker = fleet[0]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages = [{"role": "system", "content": "You audit contracts clause by clause. " * 3},
                {"role": "user", "content": [{"type": "text", "text": "Check clause 4 "},
                                             {"type": "text", "text": "and clause 7."}],
                 "name": None}]
    body = {"model": model_name, "messages": messages, "tools": tools,
            "tool_choice": "none", "cache_salt": "chat-salt", **RUN}
    httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    keyed = route_request_for("/v1/chat/completions", body, "chat-salt", TokenKeyer(tiny_model))
    assert len(keyed.prefix_hashes) >= 4
    assert {h.hex() for h in keyed.prefix_hashes} <= stored_hashes(worker)
    text_keyed = route_request_for("/v1/chat/completions", body, "chat-salt")
    assert not {h.hex() for h in text_keyed.prefix_hashes} & stored_hashes(worker)


def test_a_long_poll_answers_when_the_worker_logs_events_not_at_its_timeout(
        fleet: list[Process], model_name: str) -> None:
    worker = fleet[1]
    cursor = worker.get("/kv/events", params={"after": 0, "limit": 65536}).json()["next_seq"]
    started = time.monotonic()
    empty = worker.get("/kv/events", params={"after": cursor, "wait": 0.5}).json()
    assert empty["events"] == [] and time.monotonic() - started >= 0.45  # it waited
    body = {"model": model_name, "prompt": "A fresh prompt for the long poll. " * 4, **RUN}
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
        poll = pool.submit(client.get, f"{worker.url}/kv/events",
                           params={"after": cursor, "wait": 25.0},
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        time.sleep(0.3)
        assert not poll.done()  # waiting at the worker: nothing new yet
        sent = time.monotonic()
        client.post(f"{worker.url}/v1/completions", json=body).raise_for_status()
        page = poll.result(timeout=20).json()
    assert [e for e in page["events"] if e["type"] == "stored"]
    assert time.monotonic() - sent < 15.0  # answered by the events, not by the 25 s timeout
    bad = worker.get("/kv/events", params={"after": 0, "wait": 31})
    assert bad.status_code == 400 and "'wait'" in bad.json()["error"]["message"]
