"""End to end over ZMQ: kvserve workers publish their KV events on vLLM's wire
(`--kv-events-config`), a `precise` gateway subscribes (`--worker-kv-events`), requests go
through it with the official client, and the gateway's index matches what the workers cache."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from kvserve.gateway.forward import PREDICTED_CACHED_HEADER
from tests.gateway.conftest import SALT_SECRET, MakeClient
from tests.gateway.processes import Process, free_port, running_gateway, running_worker_set

PROMPT = "The compliance checker reads every clause of the contract and flags the risky ones. " * 2


def cached_hashes(worker: Process) -> set[str]:
    """What the worker caches now, from its own event log."""
    held: set[str] = set()
    for event in worker.get("/kv/events", params={"after": 0, "limit": 65536}).json()["events"]:
        if event["type"] == "stored":
            held.update(event["block_hashes"])
        elif event["type"] == "removed":
            held.difference_update(event["block_hashes"])
        else:
            held.clear()
    return held


@pytest.fixture(scope="module")
def zmq_fleet(tiny_model: Path, proc_logs: Path) -> Iterator[tuple[list[Process], Process]]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    flag_sets = [["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})] for pub, replay in ports]
    with running_worker_set(tiny_model, proc_logs, flag_sets) as workers:
        flags = ["--policy", "precise", "--salt-secret", SALT_SECRET]
        for worker, (pub, replay) in zip(workers, ports, strict=True):
            flags += ["--worker-kv-events",
                      f"{worker.url}=tcp://*:{pub},replay=tcp://*:{replay},topic=kv"]
        with running_gateway([w.url for w in workers], proc_logs, flags) as gateway:
            yield workers, gateway


def kv_state(gateway: Process) -> dict[str, dict[str, object]]:
    return {w["url"]: w["kv_events"] for w in gateway.get("/workers").json()["workers"]}


def test_the_gateway_follows_kvserve_workers_over_zmq_to_their_blocks(
        zmq_fleet: tuple[list[Process], Process], make_client: MakeClient,
        model_name: str) -> None:
    workers, gateway = zmq_fleet
    assert all(s["synced"] and s["source"] == "zmq" for s in kv_state(gateway).values())
    client = make_client(gateway.url)
    tenant = {"X-Tenant-Id": "acme"}
    first = client.completions.with_raw_response.create(
        model=model_name, prompt=PROMPT, max_tokens=2, temperature=0.0,
        extra_headers=tenant)
    first.parse()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the events arrive as the worker caches the blocks
        counts = {url: sum(s["blocks_by_tier"].values()) for url, s in kv_state(gateway).items()}
        if any(counts.values()):
            break
        time.sleep(0.1)
    served = [w for w in workers if counts[w.url]]
    assert len(served) == 1
    worker = served[0]
    # The index holds exactly the blocks the worker caches (every one of them on GPU).
    assert kv_state(gateway)[worker.url]["blocks_by_tier"] == {"GPU": len(cached_hashes(worker))}
    before = worker.metrics().value("vllm:prefix_cache_hits_total")
    for _ in range(2):
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2,
                                  temperature=0.0, extra_headers=tenant)
    assert worker.metrics().value("vllm:prefix_cache_hits_total") > before  # same worker, hit
    hits = gateway.metrics().value("kvserve:gateway_requests_total", worker=worker.url,
                                   branch="precise_hit")
    assert hits == 2


def _streamed(url: str, model: str, prompt: str, tenant: str) -> tuple[int, dict[str, object]]:
    """Stream a completion through the gateway: its predicted cached tokens (header) and the
    worker's usage (the last chunk's, asked for with include_usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    usage: dict[str, object] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body,
                      headers={"X-Tenant-Id": tenant}, timeout=60) as resp:
        resp.raise_for_status()
        predicted = int(resp.headers[PREDICTED_CACHED_HEADER])
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return predicted, usage


def test_the_gateway_predicts_the_cached_tokens_the_worker_reports(
        zmq_fleet: tuple[list[Process], Process], tiny_model: Path, model_name: str) -> None:
    """The header a warm prefix gets is what the worker then serves from its cache."""
    _, gateway = zmq_fleet
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    # A prompt that ends mid-block: an engine computes at least the last prompt token, so a
    # prompt of whole blocks reports one block less than it caches.
    prompt = next(p for p in (PROMPT + "Clause " + "x" * n for n in range(32))
                  if len(tokenizer.encode(p).ids) % 16)
    before = sum(sum(s["blocks_by_tier"].values()) for s in kv_state(gateway).values())
    cold, usage = _streamed(gateway.url, model_name, prompt, "predicted")
    assert cold == 0 and usage["prompt_tokens_details"] == {"cached_tokens": 0}
    deadline = time.monotonic() + 10
    while sum(sum(s["blocks_by_tier"].values()) for s in kv_state(gateway).values()) <= before:
        assert time.monotonic() < deadline, "the worker's KV events never reached the gateway"
        time.sleep(0.1)
    warm, usage = _streamed(gateway.url, model_name, prompt, "predicted")
    num_tokens = len(tokenizer.encode(prompt).ids)
    assert usage["prompt_tokens"] == num_tokens
    assert usage["prompt_tokens_details"] == {"cached_tokens": num_tokens // 16 * 16}
    assert warm == num_tokens // 16 * 16
    whole = httpx.post(f"{gateway.url}/v1/completions", headers={"X-Tenant-Id": "predicted"},
                       json={"model": model_name, "prompt": prompt, "max_tokens": 2},
                       timeout=60)
    assert whole.headers[PREDICTED_CACHED_HEADER] == str(warm)  # unstreamed answers too
    assert whole.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": warm}
