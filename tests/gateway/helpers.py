"""Small builders shared by the gateway policy tests."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from kvserve.gateway.core.pipeline import RouteRequest, WorkerView
from kvserve.gateway.core.prefix import RouteKey


def views(loads: Mapping[str, int], unhealthy: Iterable[str] = ()) -> list[WorkerView]:
    """Worker views with the given loads (as gateway in-flight counts)."""
    down = set(unhealthy)
    return [WorkerView(wid, wid not in down, in_flight=load) for wid, load in loads.items()]


def fleet(num_workers: int) -> dict[str, int]:
    """Worker ids w0..w{n-1}, all idle."""
    return {f"w{i}": 0 for i in range(num_workers)}


def request(text: str, tenant: str | None = "t", block_chars: int = 8) -> RouteRequest:
    """A request keyed by its text, with small blocks so short strings span several."""
    return RouteRequest.from_key(RouteKey.from_text(text, tenant, block_chars=block_chars))


def random_requests(count: int, seed: int = 0) -> list[RouteRequest]:
    """`count` requests with distinct random prefixes of 4-8 blocks, over 8 tenants."""
    rng = random.Random(seed)
    return [
        request(f"{rng.getrandbits(64):016x}" * rng.randint(2, 4), f"tenant-{rng.randrange(8)}")
        for _ in range(count)
    ]
