"""`POST /reset_prefix_cache` (vLLM's route, behind the admin key here): afterwards no prefix hits,
not from the device pool nor from the host tier; while a request runs it is refused with 409 and
changes nothing."""

from __future__ import annotations

import httpx

from tests.server.conftest import StartServer
from tests.server.harness import ADMIN_KEY, ServerProcess

PREFIXES = [list(range(10, 34)), list(range(100, 124))]  # 24 tokens = 6 blocks of 4 each
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _cached(http: httpx.Client, model: str, prompt: list[int]) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _census(server: ServerProcess) -> dict[str, int]:
    return server.debug_kv()["host_tier"]["census"]  # type: ignore[index]


def _host_hits(server: ServerProcess) -> float:
    return server.metrics().value("kvserve:kv_host_hit_tokens_total")


def test_after_a_reset_no_tier_serves_a_hit(start_server: StartServer) -> None:
    server = start_server(["--block-size", "4", "--num-kv-blocks", "12",
                           "--kv-host-tier-bytes", str(1 << 17)])
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for n in range(3):  # alternating: each evicts the other to the host tier
            _cached(http, model, PREFIXES[n % 2] + [5, n + 1])
        host_before = _host_hits(server)
        assert _cached(http, model, PREFIXES[1] + [5, 9]) == 24  # back from the host tier
        assert _host_hits(server) > host_before

        assert _census(server)["num_ready"] > 0  # evicted prefix blocks kept in host memory

        assert http.post("/reset_prefix_cache").status_code == 401  # the admin key only
        reset = http.post("/reset_prefix_cache", headers=ADMIN)
        assert reset.status_code == 200 and reset.content == b"", reset.text
        census = _census(server)
        assert census["num_ready"] == 0 and census["num_free"] == census["num_slots"]
        # The clear is published at once, not at the next step: no consumer reads an earlier
        # request's blocks as cached while the worker idles.
        events = http.get("/kv/events", headers=ADMIN).json()["events"]
        assert events[-1]["type"] == "cleared"

        host_before = _host_hits(server)
        assert _cached(http, model, PREFIXES[0] + [5, 7]) == 0
        assert _cached(http, model, PREFIXES[1] + [5, 8]) == 0
        assert _host_hits(server) == host_before
    report = server.debug_kv()
    assert report["audit"]["ok"] is True


def test_a_reset_while_a_request_runs_is_refused_and_changes_nothing(
        start_server: StartServer) -> None:
    server = start_server(["--block-size", "4", "--num-kv-blocks", "96"])
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        assert _cached(http, model, PREFIXES[0] + [5, 1]) == 0
        body = {"model": model, "prompt": PREFIXES[1], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            refused = httpx.post(f"{server.url}/reset_prefix_cache", headers=ADMIN,
                                 timeout=30.0)
            assert refused.status_code == 409, refused.text
            assert "in use" in refused.json()["error"]["message"]
            assert any(line == "data: [DONE]" for line in lines)
        assert _cached(http, model, PREFIXES[0] + [5, 2]) == 24  # still cached
        assert http.post("/reset_prefix_cache", headers=ADMIN).status_code == 200
        assert _cached(http, model, PREFIXES[0] + [5, 3]) == 0
