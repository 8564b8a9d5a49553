"""`kvserve serve --kv-host-tier-bytes`: the host tier is built from the flag, used by real
requests, and shown in /metrics and /debug/kv."""

from __future__ import annotations

from tests.server.conftest import StartServer

PREFIXES = [list(range(10, 34)), list(range(100, 124))]  # 24 tokens = 6 blocks of 4 each


def test_the_host_tier_serves_evicted_prefixes_and_reports_them(start_server: StartServer):
    server = start_server(["--block-size", "4", "--num-kv-blocks", "12",
                           "--kv-host-tier-bytes", str(1 << 17)])
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for n in range(4):  # alternating prefixes: each evicts the other from the device
            body = {"model": model, "prompt": PREFIXES[n % 2] + [5, n + 1],
                    "max_tokens": 4, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
    metrics = server.metrics()
    assert metrics.value("kvserve:kv_host_slots") == 64
    assert metrics.value("kvserve:kv_host_stores_total") > 0
    assert metrics.value("kvserve:kv_host_loads_total") > 0
    assert metrics.value("kvserve:kv_host_hit_tokens_total") > 0
    assert metrics.value("kvserve:kv_host_pinned_slots") == 0
    report = server.debug_kv()
    assert report["audit"]["ok"] is True
    host = report["host_tier"]
    assert host["census"]["num_slots"] == 64 and host["census"]["num_storing"] == 0
    assert host["counters"]["loads"] == metrics.value("kvserve:kv_host_loads_total")
