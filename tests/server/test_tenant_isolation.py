"""Tenants with different cache salts never share prefix blocks; the same tenant does."""

from __future__ import annotations

import random

import httpx

from kvserve.server.metrics import tenant_label
from tests.server.harness import ServerProcess

BLOCK_SIZE = 16
PROMPT_LEN = 100  # six full blocks and a partial one
FULL_BLOCK_TOKENS = PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE


def _hits(server: ServerProcess) -> float:
    return server.metrics().value("vllm:prefix_cache_hits_total")


def _tenant_hits(server: ServerProcess, salt: str) -> float:
    try:
        return server.metrics().value("kvserve:tenant_prefix_cache_hits_total",
                                      tenant=tenant_label(None, salt))
    except KeyError:  # no request of this tenant has finished yet
        return 0.0


def test_cache_salt_isolates_tenants(server: ServerProcess) -> None:
    # Token ids nobody else sends, so no earlier test warmed the cache for them.
    prompt = random.Random("tenant-isolation").choices(range(4, 300), k=PROMPT_LEN)

    def send(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "cache_salt": salt}
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] == PROMPT_LEN
        return usage["prompt_tokens_details"]["cached_tokens"]

    hits0 = _hits(server)
    assert send("tenant-a") == 0
    hits1 = _hits(server)
    assert hits1 == hits0

    # Another tenant, the very same tokens: not one block is shared.
    assert send("tenant-b") == 0
    hits2 = _hits(server)
    assert hits2 == hits1
    assert _tenant_hits(server, "tenant-b") == 0

    # The first tenant again: every full block of its prompt is a hit.
    tenant_a_before = _tenant_hits(server, "tenant-a")
    assert send("tenant-a") == FULL_BLOCK_TOKENS
    assert _hits(server) - hits2 == FULL_BLOCK_TOKENS
    assert _tenant_hits(server, "tenant-a") - tenant_a_before == FULL_BLOCK_TOKENS

    # No salt at all is a tenant of its own too.
    assert send(None) == 0

    # The per-tenant label is a hash: /metrics never shows a salt.
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    assert "tenant-a" not in text and "tenant-b" not in text
    assert f'tenant="{tenant_label(None, "tenant-a")}"' in text
