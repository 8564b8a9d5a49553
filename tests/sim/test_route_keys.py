"""The simulator's memoised route keys are the gateway's own keys, byte for byte."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.prefix import RouteKey
from kvserve.sim import RouteKeys
from kvserve.workload import TraceRequest, prompt_token_ids
from tests.sim.helpers import synthetic_trace


@pytest.mark.parametrize("block_tokens", [16, 64, 512, 100])
def test_route_keys_equal_the_gateways(block_tokens: int) -> None:
    keys = RouteKeys(block_tokens)
    requests = [*synthetic_trace(num_requests=40).requests,
                TraceRequest("no-prefix", 0.0, 1234, 5),  # Azure-like: all unique filler
                TraceRequest("short", 0.0, 700, 5, (1, 2)),  # ends inside its second block
                TraceRequest("tiny", 0.0, 10, 5, (1,), tenant="t")]
    for _ in range(2):  # the second pass is served from the memo
        for request in requests:
            tokens = prompt_token_ids(request)
            expected = RouteRequest.from_key(
                RouteKey.from_token_ids(tokens, request.tenant, block_tokens=block_tokens))
            assert keys.route_request(request, tokens) == expected


def test_tenants_never_share_a_route_key() -> None:
    keys = RouteKeys(64)
    a = TraceRequest("a", 0.0, 1024, 1, (1, 2), tenant="acme")
    b = TraceRequest("b", 0.0, 1024, 1, (1, 2), tenant="globex")
    ka = keys.route_request(a, prompt_token_ids(a))
    kb = keys.route_request(b, prompt_token_ids(b))
    assert not set(ka.prefix_hashes) & set(kb.prefix_hashes)
