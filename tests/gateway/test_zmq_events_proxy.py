"""End to end over ZMQ: kvserve workers publish their KV events on vLLM's wire
(`--kv-events-config`), a `precise` gateway subscribes (`--worker-kv-events`), requests go
through it with the official client, and the gateway's index matches what the workers cache;
two replicas that share nothing but the workers' events route a tenant to the same worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from kvserve.wire.http import PREDICTED_CACHED_HEADER
from tests.gateway.conftest import SALT_SECRET, MakeClient
from tests.gateway.processes import (
    Process,
    free_port,
    running_gateway,
    running_worker_set,
    wait_until,
)

PROMPT = "The compliance checker reads every clause of the contract and flags the risky ones. " * 2
RUN = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
Fleet = tuple[list[Process], Process, Process, list[tuple[int, int]]]  # + (pub, replay) ports


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
def zmq_fleet(tiny_model: Path, proc_logs: Path
              ) -> Iterator[Fleet]:
    ports = [(free_port(), free_port()) for _ in range(2)]
    flag_sets = [["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})] for pub, replay in ports]
    with running_worker_set(tiny_model, proc_logs, flag_sets) as workers:
        flags = ["--policy", "precise", "--salt-secret", SALT_SECRET]
        for worker, (pub, replay) in zip(workers, ports, strict=True):
            flags += ["--worker-kv-events",
                      f"{worker.url}=tcp://*:{pub},replay=tcp://*:{replay},topic=kv"]
        urls = [w.url for w in workers]
        with running_gateway(urls, proc_logs, flags) as a, \
                running_gateway(urls, proc_logs, flags) as b:
            yield workers, a, b, ports


def kv_state(gateway: Process) -> dict[str, dict[str, object]]:
    return {w["url"]: w["kv_events"] for w in gateway.get("/workers").json()["workers"]}


def test_the_gateway_follows_kvserve_workers_over_zmq_to_their_blocks(
        zmq_fleet: Fleet, make_client: MakeClient,
        model_name: str) -> None:
    workers, gateway, _, _ = zmq_fleet
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
        zmq_fleet: Fleet, tiny_model: Path, model_name: str) -> None:
    """The header a warm prefix gets is what the worker then serves from its cache."""
    _, gateway, _, _ = zmq_fleet
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


def routed(gateway: Process) -> dict[tuple[str, str], float]:
    return {(labels["worker"], labels["branch"]): value
            for name, labels, value in gateway.metrics().samples
            if name == "kvserve:gateway_requests_total"}


def send(gateway: Process, model: str, tenant: str) -> tuple[str, str]:
    """Send PROMPT for `tenant`; the (worker, branch) the gateway chose."""
    before = routed(gateway)
    httpx.post(f"{gateway.url}/v1/completions", json={"model": model, "prompt": PROMPT, **RUN},
               headers={"X-Tenant-Id": tenant}, timeout=60).raise_for_status()
    changed = [k for k, v in routed(gateway).items() if v > before.get(k, 0.0)]
    assert len(changed) == 1, changed
    return changed[0]


def test_replicas_follow_the_events_to_the_same_worker(
        zmq_fleet: Fleet, model_name: str) -> None:
    _, a, b, _ = zmq_fleet
    first_worker, first_branch = send(a, model_name, "initech")
    assert first_branch == "least_load"  # nobody holds this tenant's prompt yet
    wait_until(lambda: b.metrics().value("kvserve:gateway_kv_events_total", worker=first_worker,
                                         type="stored") > 0, 10.0, "replica b to see the blocks")
    assert send(b, model_name, "initech") == (first_worker, "precise_hit")
    assert send(a, model_name, "initech") == (first_worker, "precise_hit")
    # The same text for another tenant hashes under another salt: no hit anywhere.
    assert send(b, model_name, "hooli")[1] == "least_load"


def test_a_discovered_worker_is_followed_on_the_ports_every_worker_shares(
        zmq_fleet: Fleet, tmp_path: Path, proc_logs: Path, model_name: str) -> None:
    """--workers-file and one --worker-kv-events without a URL, as a Deployment's gateway runs:
    the worker is followed from when it is discovered (a late join: its history replayed)."""
    workers, _, _, ports = zmq_fleet
    (pub, replay), url = ports[0], workers[0].url
    listing = tmp_path / "workers"
    listing.write_text(f"{url}\n")
    flags = ["--policy", "precise", "--salt-secret", SALT_SECRET, "--workers-file", str(listing),
             "--worker-kv-events", f"tcp://*:{pub},replay=tcp://*:{replay},topic=kv"]
    with running_gateway([], proc_logs, flags, expect_healthy=1) as gateway:
        wait_until(lambda: (kv_state(gateway)[url] or {}).get("synced") is True, 10.0,
                   "the discovered worker's index to sync", gateway.log)
        send(gateway, model_name, "umbrella")
        wait_until(lambda: gateway.metrics().value("kvserve:gateway_kv_events_total", worker=url,
                                                   type="stored") > 0, 10.0, "stored events")
        assert gateway.metrics().value("kvserve:gateway_kv_event_resyncs_total", worker=url,
                                       reason="join") == 1
        assert "no KV events from" not in gateway.log()
