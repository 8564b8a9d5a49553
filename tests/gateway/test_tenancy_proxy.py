"""Tenancy end to end, as a hostile tenant tries it: two real workers that take salts only from
their gateway (`--trusted-salt-key`) and keys only from it (`--api-key`), a real gateway that
maps API keys to tenants, and the official `openai` client. Tenant A, holding only its own key,
cannot obtain one cached token of tenant B's by any header, body field or salt it can compute
(not even B's real salt, nor the real salt key); tenants of one sharing group do share; a client
straight at a worker without the gateway's salt key can neither use nor probe a tenant's cache."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.gateway.core.tenancy import Tenancy
from tests.gateway.processes import Process, running_gateway, running_workers

SECRET = "tenancy-proxy-test-secret-0123456789"
SALT_KEY = "tenancy-proxy-test-salt-key"
WORKER_KEY = "tenancy-proxy-test-worker-key"
KEYS = {"team-a": "key-of-team-a-0123456789", "team-b": "key-of-team-b-0123456789",
        "team-c": "key-of-team-c-0123456789"}
PROMPT_LEN = 96  # six blocks of 16: a hit is at least 80 cached tokens
B_SALT = Tenancy(SECRET).salt_for("team-b")


@pytest.fixture(scope="module")
def workers(tiny_model: Path, proc_logs: Path) -> Iterator[list[Process]]:
    flags = ["--trusted-salt-key", SALT_KEY, "--api-key", WORKER_KEY]
    with running_workers(tiny_model, proc_logs, 2, flags) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(workers: list[Process], proc_logs: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Process]:
    keys_file = tmp_path_factory.mktemp("tenancy") / "keys"
    keys_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()), encoding="utf-8")
    flags = ["--api-keys-file", str(keys_file), "--worker-api-key", WORKER_KEY,
             "--salt-secret", SECRET, "--trusted-salt-key", SALT_KEY,
             "--share-group", "team-a=partners", "--share-group", "team-c=partners"]
    with running_gateway([w.url for w in workers], proc_logs, flags,
                         trust_tenant_header=False) as gw:
        yield gw


def prompt_of(seed: str) -> list[int]:
    return random.Random(seed).choices(range(4, 300), k=PROMPT_LEN)


def cached_tokens(url: str, key: str, prompt: list[int], model: str,
                  headers: dict[str, str] | None = None,
                  body: dict[str, object] | None = None) -> int:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60.0)
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       temperature=0.0, extra_headers=headers or {},
                                       extra_body=body or {})
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def warm_everywhere(workers: list[Process], prompt: list[int], salt: str, model: str) -> None:
    """Cache `prompt` under `salt` on every worker, as the gateway would, so that wherever a
    request lands, a salt that leaked would hit."""
    for worker in workers:
        cached_tokens(worker.url, WORKER_KEY, prompt, model,
                      {"X-KVServe-Salt-Key": SALT_KEY}, {"cache_salt": salt})
        assert cached_tokens(worker.url, WORKER_KEY, prompt, model,
                             {"X-KVServe-Salt-Key": SALT_KEY}, {"cache_salt": salt}) >= 80


ATTACKS = {
    "tenant-header": ({"X-Tenant-Id": "team-b"}, {}),
    "b-real-salt": ({}, {"cache_salt": B_SALT}),
    "old-default-salt": ({}, {"cache_salt": hashlib.sha256(b"kvserve\x00team-b")
                              .hexdigest()[:32]}),
    "salt-key-and-salt": ({"X-KVServe-Salt-Key": SALT_KEY}, {"cache_salt": B_SALT}),
    "user-field": ({}, {"user": "team-b"}),
    "everything": ({"X-Tenant-Id": "team-b", "X-KVServe-Salt-Key": SALT_KEY,
                    "X-Forwarded-User": "team-b"}, {"cache_salt": B_SALT, "user": "team-b"}),
}


def test_a_tenant_gets_no_cached_token_of_another(gateway: Process, workers: list[Process],
                                                  model_name: str) -> None:
    for name, (headers, body) in ATTACKS.items():
        prompt = prompt_of(f"b-secret-{name}")
        assert cached_tokens(gateway.url, KEYS["team-b"], prompt, model_name) == 0
        warm_everywhere(workers, prompt, B_SALT, model_name)
        assert cached_tokens(gateway.url, KEYS["team-b"], prompt, model_name) >= 80
        got = cached_tokens(gateway.url, KEYS["team-a"], prompt, model_name, headers, body)
        assert got == 0, f"{name}: tenant a got {got} of tenant b's cached tokens"
        # a's own copy is cached now: the same request hits, so the zero above was a miss
        assert cached_tokens(gateway.url, KEYS["team-a"], prompt, model_name, headers,
                             body) >= 80


def test_a_key_the_gateway_does_not_list_is_refused(gateway: Process, model_name: str) -> None:
    prompt = prompt_of("refused")
    for key in ("not-a-tenant-key-0000", KEYS["team-a"] + "x", WORKER_KEY):
        with pytest.raises(openai.AuthenticationError, match="--api-keys-file"):
            cached_tokens(gateway.url, key, prompt, model_name, {"X-Tenant-Id": "team-b"})


def test_a_sharing_group_shares_its_prefixes(gateway: Process, model_name: str) -> None:
    prompt = prompt_of("partners")
    assert cached_tokens(gateway.url, KEYS["team-c"], prompt, model_name) == 0
    assert cached_tokens(gateway.url, KEYS["team-a"], prompt, model_name) >= 80
    assert cached_tokens(gateway.url, KEYS["team-b"], prompt, model_name) == 0


def test_a_client_at_a_worker_cannot_use_or_probe_a_tenants_cache(
        workers: list[Process], model_name: str) -> None:
    prompt = prompt_of("direct")
    warm_everywhere(workers, prompt, B_SALT, model_name)
    for worker in workers:
        for key in (KEYS["team-a"], KEYS["team-b"]):  # tenants' keys are the gateway's only
            with pytest.raises(openai.AuthenticationError):
                cached_tokens(worker.url, key, prompt, model_name)
        # Even with the worker's key, no salt or tenant header without the gateway's salt key:
        for headers, body in (({}, {"cache_salt": B_SALT}), ({"X-Tenant-Id": "team-b"}, {}),
                              ({"X-KVServe-Salt-Key": "guessed"}, {"cache_salt": B_SALT})):
            with pytest.raises(openai.PermissionDeniedError, match="--trusted-salt-key"):
                cached_tokens(worker.url, WORKER_KEY, prompt, model_name, headers, body)
        # and unsalted, the same tokens hit none of the tenant's blocks
        assert cached_tokens(worker.url, WORKER_KEY, prompt, model_name) == 0
    refused = httpx.get(f"{workers[0].url}/metrics").text
    assert "kvserve:untrusted_salt_requests_total" in refused
