"""Feeding the `precise` policy from a worker's event pages (no HTTP: the page format only)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from kvserve.gateway.kv_events import EventFollower, apply_page
from kvserve.gateway.policies import PrecisePolicy, RouteRequest
from kvserve.gateway.upstream_http import UpstreamClient
from kvserve.gateway.worker_pool import WorkerPool
from tests.gateway.helpers import views

H = [bytes([i]) * 32 for i in range(6)]


def page(*events: dict[str, object]) -> list[dict[str, object]]:
    return list(events)


def stored(*hashes: bytes) -> dict[str, object]:
    return {"type": "stored", "block_hashes": [h.hex() for h in hashes]}


def removed(*hashes: bytes) -> dict[str, object]:
    return {"type": "removed", "block_hashes": [h.hex() for h in hashes]}


def hits(policy: PrecisePolicy, hashes: tuple[bytes, ...]) -> int:
    decision = policy.route(RouteRequest(hashes, "t", 64), views({"w": 0, "v": 0}))
    return decision.predicted_hit_blocks if decision.worker_id == "w" else 0


def test_events_apply_in_order_across_kinds() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    applied = apply_page(policy, "w", page(stored(H[0], H[1], H[2]), removed(H[2]),
                                           stored(H[2], H[3])), gap=False)
    assert applied == 3
    assert hits(policy, (H[0], H[1], H[2], H[3])) == 4  # removed, then stored again: held
    apply_page(policy, "w", page(removed(H[1])), gap=False)
    assert hits(policy, (H[0], H[1], H[2], H[3])) == 1  # the chain breaks at the hole
    apply_page(policy, "w", page({"type": "cleared"}, stored(H[4])), gap=False)
    assert hits(policy, (H[0],)) == 0 and hits(policy, (H[4],)) == 1


def test_a_gap_forgets_the_worker_before_applying_the_page() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    apply_page(policy, "w", page(stored(H[0], H[1])), gap=False)
    apply_page(policy, "w", page(stored(H[5])), gap=True)
    assert hits(policy, (H[0], H[1])) == 0 and hits(policy, (H[5],)) == 1


def test_a_malformed_event_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown KV event type"):
        apply_page(PrecisePolicy(), "w", page({"type": "moved"}), gap=False)
    with pytest.raises(ValueError):
        apply_page(PrecisePolicy(), "w", page({"type": "stored", "block_hashes": ["zz"]}),
                   gap=False)


def test_a_worker_with_events_every_step_is_polled_at_most_every_min_interval() -> None:
    asyncio.run(_follow_a_busy_worker())


async def _follow_a_busy_worker() -> None:
    # A busy worker has a new event for every poll; the follower still batches them.
    seq = {"n": 0}

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # keep-alive: one poll after another on this connection
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /kv/events?after=")
                seq["n"] += 1
                event = {"type": "stored", "block_hashes": [bytes([seq["n"] % 256]).hex() * 32]}
                body = json.dumps({"events": [event], "next_seq": seq["n"]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    policy = PrecisePolicy()
    client = UpstreamClient()
    try:
        follower = EventFollower(WorkerPool([url]), policy, client, min_interval_s=0.1)
        follower.start()
        await asyncio.sleep(0.55)
        await follower.stop()
    finally:
        await client.aclose()
        server.close()
    assert 4 <= follower.polls <= 7  # uncapped, this loop polls thousands of times
    assert follower.applied == follower.polls and policy.num_cached_blocks(url) > 0
