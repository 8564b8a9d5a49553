"""Seniority: a resend is recognised by tenant, path and body, keeps its first time until it is
served or too old, and memory stays bounded."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.seniority import Seniority, request_key

BODY = b'{"model": "m", "prompt": "hello", "max_tokens": 4}'


def test_a_resend_keeps_the_time_of_its_first_send_until_served() -> None:
    seniority = Seniority(ttl_s=60.0)
    key = request_key("tenant-a", "/v1/completions", BODY)
    assert seniority.since(key, 10.0) == 10.0
    assert seniority.since(key, 13.0) == 10.0  # resent after a 429
    assert seniority.since(key, 17.0) == 10.0  # and after a timeout
    seniority.served(key)
    assert seniority.since(key, 20.0) == 20.0  # asked again later: a new request


def test_a_record_older_than_the_ttl_is_a_new_request() -> None:
    seniority = Seniority(ttl_s=60.0)
    key = request_key(None, "/v1/completions", BODY)
    seniority.since(key, 0.0)
    assert seniority.since(key, 61.0) == 61.0
    assert seniority.since(key, 62.0) == 61.0


def test_tenant_path_and_body_each_make_a_different_request() -> None:
    keys = {request_key("a", "/v1/completions", BODY), request_key("b", "/v1/completions", BODY),
            request_key(None, "/v1/completions", BODY),
            request_key("a", "/v1/chat/completions", BODY),
            request_key("a", "/v1/completions", BODY + b" ")}
    assert len(keys) == 5
    assert request_key("a", "/v1/completions", BODY) == request_key("a", "/v1/completions",
                                                                     bytes(BODY))


def test_memory_is_bounded_by_forgetting_the_least_recently_asked() -> None:
    seniority = Seniority(ttl_s=1e9, max_keys=3)
    keys = [request_key(None, "/p", b"%d" % i) for i in range(5)]
    for t, key in enumerate(keys[:3]):
        seniority.since(key, float(t))
    seniority.since(keys[0], 5.0)  # asked again: now the most recent
    seniority.since(keys[3], 6.0)
    seniority.since(keys[4], 7.0)
    assert len(seniority) == 3
    assert seniority.since(keys[0], 8.0) == 0.0  # kept
    assert seniority.since(keys[1], 9.0) == 9.0  # forgotten


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Seniority(ttl_s=0)
    with pytest.raises(ValueError):
        Seniority(max_keys=0)
