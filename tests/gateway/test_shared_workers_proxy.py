"""Two real gateways in front of the same real workers: the one that routes nothing sees the
other's requests on the workers and says so (/workers, /metrics, a warning in its log naming the
fix for its replica-unsafe policy, cache_aware placing new prefixes by footprint); the one
sending them sees nothing foreign."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.gateway.conftest import SALT_SECRET, MakeClient
from tests.gateway.processes import Process, running_gateway, wait_until


def test_a_gateway_sees_another_routers_requests_on_its_workers(
        fleet: list[Process], proc_logs: Path, make_client: MakeClient, model_name: str) -> None:
    # Both gateways start here: the package's shared one has seen other tests' requests sent
    # straight to the workers, which are foreign to it.
    urls = [w.url for w in fleet]
    flags = ["--policy", "cache_aware", "--policy-option", "cold_placement=footprint",
             "--salt-secret", SALT_SECRET]
    with (running_gateway(urls, proc_logs, ["--policy", "prefix_hash", "--salt-secret",
                                            SALT_SECRET]) as gateway,
          running_gateway(urls, proc_logs, flags) as watcher):
        assert watcher.get("/workers").json()["shared_workers"]["detected"] is False
        stop = threading.Event()
        client = make_client(gateway.url)

        def keep_streaming(i: int) -> None:  # through the other gateway (prefix_hash)
            while not stop.is_set():
                stream = client.completions.create(
                    model=model_name, prompt=f"client {i} asks about the weather", stream=True,
                    max_tokens=64, temperature=0.0, extra_body={"ignore_eos": True})
                for _ in stream:
                    if stop.is_set():
                        break
                stream.close()

        threads = [threading.Thread(target=keep_streaming, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: watcher.get("/workers").json()["shared_workers"]["detected"],
                       30.0, "the idle gateway to see the other's requests",
                       lambda: watcher.get("/workers").json())
        finally:
            stop.set()
            for thread in threads:
                thread.join(30.0)
        seen = watcher.get("/workers").json()
        assert seen["shared_workers"]["foreign_share"] > 0.9  # it sent none of them
        assert seen["shared_workers"]["replica_safe"] is False
        assert watcher.metrics().value("kvserve:gateway_shared_workers", policy="cache_aware",
                                       replica_safe="false") == 1.0
        assert "places a new prefix by what this gateway alone has routed" in watcher.log()
        assert "--policy cache_aware" in watcher.log()
        sender = gateway.get("/workers").json()
        assert sender["shared_workers"]["detected"] is False
        assert gateway.metrics().value("kvserve:gateway_foreign_load_share",
                                       policy="prefix_hash") == 0.0
