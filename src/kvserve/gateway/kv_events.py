"""Follows each kvserve worker's KV events (`GET /kv/events`) into the `precise` policy.

One background task per gateway polls every worker every `interval_s` for the events after its
cursor and applies them in order (runs of one kind at a time, since `apply_events` applies
cleared, removed, stored in that order). A gap (the worker dropped events this gateway had not
read, or restarted) clears the worker's index: what the worker caches is then learned again from
new events. A worker that does not serve the route (vLLM, SGLang) is polled no further; routing
to it falls back to the pending prefixes the policy records itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Protocol

import httpx

from kvserve.gateway.periodic import Periodic
from kvserve.gateway.worker_pool import WorkerPool

EVENTS_PATH = "/kv/events"


class EventSink(Protocol):
    def apply_events(self, worker_id: str, stored: Iterable[bytes] = (),
                     removed: Iterable[bytes] = (), cleared: bool = False) -> None: ...


def apply_page(sink: EventSink, worker_id: str, events: list[dict[str, Any]],
               gap: bool) -> int:
    """Apply one page of events in order; the number applied. Raises ValueError for a malformed
    event (the caller stops following that worker)."""
    if gap:
        sink.apply_events(worker_id, cleared=True)
    kind: str | None = None
    run: list[bytes] = []

    def flush() -> None:
        if kind == "stored":
            sink.apply_events(worker_id, stored=run)
        elif kind == "removed":
            sink.apply_events(worker_id, removed=run)

    for event in events:
        etype = event.get("type")
        if etype == "cleared":
            flush()
            kind, run = None, []
            sink.apply_events(worker_id, cleared=True)
            continue
        if etype not in ("stored", "removed"):
            raise ValueError(f"unknown KV event type {etype!r}")
        if etype != kind:
            flush()
            kind, run = etype, []
        run.extend(bytes.fromhex(h) for h in event["block_hashes"])
    flush()
    return len(events)


class EventFollower(Periodic):
    """Polls `/kv/events` of every worker in `pool` and feeds `sink` (see the module doc)."""

    def __init__(self, pool: WorkerPool, sink: EventSink, client: httpx.AsyncClient,
                 interval_s: float = 0.25, admin_key: str | None = None) -> None:
        self.pool, self.sink, self.client = pool, sink, client
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.cursors: dict[str, int] = {}
        self.unsupported: set[str] = set()
        self.applied = 0

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(url) for url in self.pool.workers
                               if url not in self.unsupported))

    tick = poll_once

    async def _poll(self, url: str) -> None:
        after = self.cursors.get(url, 0)
        try:
            resp = await self.client.get(f"{url}{EVENTS_PATH}", params={"after": after},
                                         headers=self.headers, timeout=2.0)
        except httpx.HTTPError:
            return  # down: the scraper ejects it; its cursor stays for when it is back
        if resp.status_code == 404:
            self.unsupported.add(url)
            return
        if resp.status_code != 200:
            return
        try:
            page = resp.json()
            self.applied += apply_page(self.sink, url, page["events"], bool(page.get("gap")))
            self.cursors[url] = int(page["next_seq"])
        except (ValueError, KeyError, TypeError):
            self.unsupported.add(url)  # not kvserve's event format: stop following it
