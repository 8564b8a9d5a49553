"""Discovery with real processes: a real `kvserve gateway` following a workers file (renamed
into place, as a ConfigMap update is) and a DNS name, in front of real `kvserve serve` workers,
driven with the official `openai` client."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvserve.gateway.fleet.discovery import worker_urls
from tests.gateway.conftest import MakeClient
from tests.gateway.processes import ADMIN_KEY, Process, wait_until
from tests.gateway.tcp_proxy import FaultyProxy, Stall

INTERVAL = ("--discovery-interval", "0.2")
STALL_S = 6.0  # how long the leaving worker's answer is held, so it is in flight for sure


def write_atomically(path: Path, urls: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# the fleet\n" + "".join(f"{url}\n" for url in urls))
    os.replace(tmp, path)


def start_gateway(log_dir: Path, *flags: str) -> Process:
    return Process("gateway", ["gateway", "--policy", "prefix_hash", "--trust-tenant-header",
                               "--admin-key", ADMIN_KEY, *INTERVAL, *flags], log_dir)


def workers_of(gateway: Process) -> dict[str, dict[str, object]]:
    return {w["url"]: w for w in gateway.get("/workers").json()["workers"]}


def routed_to(gateway: Process, url: str) -> float:
    """Requests the gateway routed to `url` (0 when it has no series for it)."""
    try:
        return gateway.metrics().value("kvserve:gateway_requests_total", worker=url)
    except KeyError:
        return 0.0


def finished(worker: Process) -> float:
    return worker.metrics().value("vllm:request_success_total")


def test_workers_file_add_then_remove_while_a_stream_is_in_flight(
        fleet: list[Process], proc_logs: Path, tmp_path: Path, make_client: MakeClient,
        model_name: str) -> None:
    first_proxy = FaultyProxy(fleet[0].port)  # the first worker, reached through a TCP proxy
    first, second = first_proxy.url, fleet[1].url  # that can hold its answers back
    path = tmp_path / "workers"
    write_atomically(path, [first])
    gateway = start_gateway(proc_logs, "--workers-file", str(path))
    try:
        gateway.wait_ready(lambda r: r.json().get("healthy_workers") == 1)
        client = make_client(gateway.url)
        done = client.completions.create(model=model_name, prompt="Hello there",
                                         max_tokens=4)
        assert done.choices[0].finish_reason in ("length", "stop")
        chat = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert chat.choices[0].message.content is not None
        assert routed_to(gateway, first) == 2

        # A second worker appears in the file: routed to within a few intervals.
        before = finished(fleet[1])
        write_atomically(path, [first, second])
        wait_until(lambda: second in workers_of(gateway), 10.0, "the second worker",
                   lambda: workers_of(gateway))
        for i in range(16):
            client.completions.create(model=model_name, prompt=f"tenant {i} asks", max_tokens=2,
                                      extra_headers={"X-Tenant-Id": f"tenant-{i}"})
        assert routed_to(gateway, second) > 0
        assert finished(fleet[1]) > before  # the worker's own counter says so too

        # A stream in flight on the first worker (its answer held back by the proxy) when
        # the first worker leaves the file: it finishes, and nothing new goes there.
        first_proxy.arm(Stall(offset=1, seconds=STALL_S), methods=("POST",))
        stream: dict[str, object] = {}

        def read_stream(tenant: str) -> None:
            chunks = list(client.completions.create(
                model=model_name, prompt="a long story", max_tokens=8, stream=True,
                extra_body={"ignore_eos": True}, extra_headers={"X-Tenant-Id": tenant}))
            stream["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
            stream["finish"] = [c.choices[0].finish_reason for c in chunks
                                if c.choices and c.choices[0].finish_reason]

        # A tenant whose prefix goes to the first worker: try until the proxy holds one.
        reader = None
        for i in range(64):
            elsewhere = routed_to(gateway, second)
            reader = threading.Thread(target=read_stream, args=(f"streamer-{i}",), daemon=True)
            reader.start()
            wait_until(lambda: bool(first_proxy.num_faults_fired)
                       or routed_to(gateway, second) > elsewhere,  # noqa: B023
                       10.0, "the stream routed")
            if first_proxy.num_faults_fired:
                break
            reader.join(30.0)
        assert reader is not None and first_proxy.num_faults_fired == 1
        assert workers_of(gateway)[first]["in_flight"] == 1
        write_atomically(path, [second])
        wait_until(lambda: workers_of(gateway).get(first, {}).get("draining") is True, 10.0,
                   "the first worker draining", lambda: workers_of(gateway))
        assert gateway.get("/health").json()["draining_workers"] == 1
        sent_first = routed_to(gateway, first)
        for i in range(8):
            client.completions.create(model=model_name, prompt=f"later {i}", max_tokens=2,
                                      extra_headers={"X-Tenant-Id": f"tenant-{i}"})
        assert routed_to(gateway, first) == sent_first  # no new request to a leaving worker
        reader.join(STALL_S + 30.0)
        assert not reader.is_alive()
        assert stream["finish"] == ["length"] and stream["text"]  # nothing lost
        wait_until(lambda: first not in workers_of(gateway), 10.0, "the first worker forgotten")
        assert f'worker="{first}"' not in gateway.get("/metrics").text
        assert gateway.metrics().value("kvserve:gateway_discovered_workers", source="file") == 1
    finally:
        gateway.stop()
        first_proxy.close()


def test_worker_dns_resolves_at_start(fleet: list[Process], proc_logs: Path,
                                      make_client: MakeClient, model_name: str) -> None:
    (url,) = worker_urls(["127.0.0.1"], fleet[0].port)  # what localhost answers here
    gateway = start_gateway(proc_logs, "--worker-dns", f"localhost:{fleet[0].port}")
    try:
        gateway.wait_ready(lambda r: r.json().get("healthy_workers") == 1)
        assert list(workers_of(gateway)) == [url]
        answer = make_client(gateway.url).completions.create(model=model_name, prompt="Hi",
                                                             max_tokens=2)
        assert answer.choices[0].text is not None and routed_to(gateway, url) == 1
        metrics = gateway.metrics()
        assert metrics.value("kvserve:gateway_discovered_workers", source="dns") == 1
        assert metrics.value("kvserve:gateway_discovery_errors_total", source="dns") == 0
    finally:
        gateway.stop()


@pytest.mark.parametrize("flags, message", [
    (["--workers-file", "/nonexistent/kvserve-workers"], "one worker URL per line"),
    (["--worker-dns", "kvserve-worker"], "--worker-dns NAME:PORT"),
])
def test_bad_discovery_flags_refuse_to_start_saying_how_to_fix_them(
        flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "gateway", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in " ".join(result.stderr.split())
