"""The client's patience: how long it will wait for its response to start (shared by the
gateway and the worker, so it imports nothing).

A client that times out and resends is how a retry storm starts, so the gateway and the workers
act on its timeout when it says one: the gateway waits no longer for an admission slot than
leaves the worker time to answer, gives up on a worker that has not started answering by the
deadline (closing the upstream request frees the worker's blocks, whatever the worker), and
forwards what is left of the budget to the worker in `TIMEOUT_HEADER`; a kvserve worker ends a
request that has not started answering by then (engine TIMEOUT, its blocks freed) even if it
never sees the client leave.

The timeout bounds the wait for the response's first byte: the first token of a stream, the
whole answer otherwise. That is what clients mean by it: the OpenAI SDKs send their read
timeout as `x-stainless-read-timeout` with every request, and an Envoy or Istio in front sends
the route's timeout as `x-envoy-expected-rq-timeout-ms`. The tightest one given wins.

The OpenAI SDKs (and every other Stainless-generated SDK) also send how many retries an attempt
follows, `x-stainless-retry-count`; such a client counts a 429 against the same `max_retries`
(2 by default) as a timeout, so refusing its request spends one of its few attempts
(`refusals_spend_retries`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

TIMEOUT_HEADER = "x-kvserve-timeout"  # seconds; what the gateway forwards to workers
SDK_TIMEOUT_HEADER = "x-stainless-read-timeout"  # seconds; sent by the OpenAI SDKs
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"  # retries taken; sent by the OpenAI SDKs
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"  # milliseconds

_SECONDS_PER_UNIT = {TIMEOUT_HEADER: 1.0, SDK_TIMEOUT_HEADER: 1.0, ENVOY_TIMEOUT_HEADER: 1e-3}


class BadTimeout(ValueError):
    """A timeout header that is not a positive number; the message says how to fix it."""


def client_timeout_s(headers: Mapping[str, str]) -> float | None:
    """The tightest timeout in `headers` (lower-case names), in seconds; None when none is
    given. Raises BadTimeout for a value that is not a positive finite number."""
    best: float | None = None
    for name, scale in _SECONDS_PER_UNIT.items():
        raw = headers.get(name)
        if raw is None:
            continue
        unit = "milliseconds" if scale != 1.0 else "seconds"
        try:
            value = float(raw) * scale
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise BadTimeout(f"header {name} must be a positive number of {unit}, got {raw!r}")
        best = value if best is None else min(best, value)
    return best


def refusals_spend_retries(headers: Mapping[str, str]) -> bool:
    """Whether the client is an SDK that counts a 429 as one of its retries: it says how many
    it has taken (`SDK_RETRY_COUNT_HEADER`, lower-case names), whatever the value."""
    return SDK_RETRY_COUNT_HEADER in headers


def format_timeout(seconds: float) -> str:
    """`TIMEOUT_HEADER`'s value for `seconds` left (millisecond precision, never 0)."""
    return f"{max(seconds, 0.001):.3f}"
