"""A worker's surface as a hostile client meets it: salts and tenant headers only from its
gateway (`--trusted-salt-key`), admin routes only with their own key, no route list, /metrics
behind a key and without tenant names unless asked, and vLLM's limits on a request."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from kvserve.server.metrics import tenant_label
from tests.server.conftest import API_KEY, StartServer
from tests.server.harness import ADMIN_KEY, ServerProcess

SALT_KEY = "gateway-salt-key-for-tests"
METRICS_KEY = "metrics-key-for-tests"
GATEWAY = {"X-KVServe-Salt-Key": SALT_KEY}


@pytest.fixture(scope="module")
def guarded(start_server: StartServer) -> ServerProcess:
    """Refuses untrusted salts; /metrics needs a key; tenants named by the gateway label
    metrics; an API key for clients."""
    return start_server(["--trusted-salt-key", SALT_KEY, "--metrics-key", METRICS_KEY,
                         "--tenant-metric-labels"], api_key=API_KEY)


@pytest.fixture(scope="module")
def stripping(start_server: StartServer) -> ServerProcess:
    """Strips untrusted salts; serves the API docs; an API key but no admin key."""
    return start_server(["--trusted-salt-key", SALT_KEY, "--untrusted-salt", "strip",
                         "--enable-api-docs"], api_key=API_KEY, admin_key=None)


def prompt_of(seed: str, n: int = 80) -> list[int]:
    return random.Random(seed).choices(range(4, 300), k=n)


def cached(server: ServerProcess, prompt: list[int], salt: str | None,
           headers: dict[str, str]) -> int:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=60.0)
    extra = {} if salt is None else {"cache_salt": salt}
    answer = client.completions.create(model=None, prompt=prompt, max_tokens=1,  # type: ignore[arg-type]
                                       temperature=0.0, extra_body=extra,
                                       extra_headers=headers)
    details = answer.usage.prompt_tokens_details if answer.usage else None
    return (details.cached_tokens or 0) if details else 0


def untrusted_count(server: ServerProcess, action: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10.0,
                        headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    for line in metrics.splitlines():
        if line.startswith("kvserve:untrusted_salt_requests_total") and action in line:
            return float(line.split()[-1])
    return 0.0


def test_a_salt_without_the_gateway_key_is_refused_and_counted(guarded: ServerProcess) -> None:
    prompt = prompt_of("refused")
    assert cached(guarded, prompt, "tenant-salt", GATEWAY) == 0
    assert cached(guarded, prompt, "tenant-salt", GATEWAY) == 64  # the gateway's salt works
    before = untrusted_count(guarded, "refuse")
    for headers, salt in (({}, "tenant-salt"), ({"X-KVServe-Salt-Key": "guess"}, "tenant-salt"),
                          ({"X-Tenant-Id": "team-a"}, None)):
        with pytest.raises(openai.PermissionDeniedError, match="--trusted-salt-key"):
            cached(guarded, prompt, salt, headers)
    assert untrusted_count(guarded, "refuse") == before + 3
    assert cached(guarded, prompt, None, {}) == 0  # unsalted: none of the tenant's blocks


def test_a_stripped_salt_reaches_no_tenant_block(stripping: ServerProcess) -> None:
    prompt = prompt_of("stripped")
    assert cached(stripping, prompt, "tenant-salt", GATEWAY) == 0
    assert cached(stripping, prompt, "tenant-salt", {}) == 0  # served unsalted
    assert cached(stripping, prompt, "tenant-salt", GATEWAY) == 64
    assert untrusted_count(stripping, "strip") >= 1


def test_admin_routes_need_their_own_key(guarded: ServerProcess,
                                         stripping: ServerProcess) -> None:
    tenant_key = {"Authorization": f"Bearer {API_KEY}"}
    admin_key = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for path in ("/debug/kv", "/kv/events"):
        assert httpx.get(f"{guarded.url}{path}", headers=tenant_key).status_code == 401
        assert httpx.get(f"{guarded.url}{path}").status_code == 401
        assert httpx.get(f"{guarded.url}{path}", headers=admin_key).status_code == 200
        for key in (admin_key, tenant_key):  # the API key never stands in for an admin key
            absent = httpx.get(f"{stripping.url}{path}", headers=key)
            assert absent.status_code == 404, absent.text
            assert "--admin-key" in absent.json()["error"]["message"]
    prefill = httpx.post(f"{stripping.url}/kv/prefill", json={}, headers=admin_key)
    assert prefill.status_code == 404


def test_the_route_list_is_served_only_when_asked(server: ServerProcess,
                                                  stripping: ServerProcess) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}").status_code == 404
        assert httpx.get(f"{stripping.url}{path}").status_code == 200


def test_metrics_need_the_key_and_name_tenants_only_when_asked(
        guarded: ServerProcess, server: ServerProcess) -> None:
    assert httpx.get(f"{guarded.url}/metrics").status_code == 401
    assert httpx.get(f"{guarded.url}/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
    cached(guarded, prompt_of("labels"), "labelled-salt", {**GATEWAY, "X-Tenant-Id": "team-x"})
    text = httpx.get(f"{guarded.url}/metrics",
                     headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    assert 'tenant="team-x"' in text
    # Without --tenant-metric-labels a client's tenant header names nothing: the salt's hash.
    cached(server, prompt_of("hashed"), "hashed-salt", {"X-Tenant-Id": "team-secret"})
    plain = httpx.get(f"{server.url}/metrics").text
    assert "team-secret" not in plain and "hashed-salt" not in plain
    assert f'tenant="{tenant_label(None, "hashed-salt")}"' in plain


def post(server: ServerProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60.0)


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 10**9},
     "maximum context length is 256 tokens"),
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 57},
     "(57 > 256 - 200)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10**9}, "'max_tokens' is too large"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "needs 'content'"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None},
                                           {"role": "user", "content": "hi"}]},
     "needs 'content'"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 1025]}, "--max-stop-chars"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * (1 << 20)]}, "--max-stop-chars"),
    ("/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]},
     "--max-stop-sequences"),
])
def test_requests_beyond_the_limits_are_400s(server: ServerProcess, path: str,
                                             body: dict[str, object], says: str) -> None:
    answer = post(server, path, body)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]["message"]


def test_requests_at_the_limits_are_served(server: ServerProcess) -> None:
    assert post(server, "/v1/completions",
                {"prompt": [5] * 200, "max_tokens": 56, "ignore_eos": True}).status_code == 200
    assert post(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
        "max_tokens": 2}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                            "stop": ["x" * 1024] * 16}).status_code == 200
