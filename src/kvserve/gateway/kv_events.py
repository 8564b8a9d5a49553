"""Follows each kvserve worker's KV events (`GET /kv/events`) into the `precise` policy.

One background task per worker long-polls it (`?wait=`: the worker answers as soon as it has
events after the cursor, or after `wait_s` with none) and applies them in order (runs of one
kind at a time, since `apply_events` applies cleared, removed, stored in that order). A gap (the
worker dropped events this gateway had not read, or restarted) clears the worker's index: what
the worker caches is then learned again from new events. A worker that does not serve the route
(vLLM, SGLang) is polled no further; routing to it falls back to the pending prefixes the policy
records itself. Polls go through the gateway's lean `UpstreamClient`: a busy worker is read
several times a second by every replica, so each poll's CPU counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import Any, Protocol

from kvserve.gateway.upstream_http import UpstreamClient, UpstreamError
from kvserve.gateway.worker_pool import WorkerPool

EVENTS_PATH = "/kv/events"
DEFAULT_WAIT_S = 5.0  # how long a worker may hold a poll open with nothing new
DEFAULT_MIN_POLL_INTERVAL_S = 0.05
"""The shortest time between two polls of one worker. A busy worker logs events every engine
step (every few ms), and each poll costs its HTTP server CPU on the cores the engine runs on,
once per gateway replica: the cap bounds that at 20 answers a second per replica, whatever the
step rate. Events then batch for up to 50 ms, a small part of the prefill they describe."""


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


class EventFollower:
    """Follows `/kv/events` of every worker in `pool` into `sink` (see the module doc): one
    long-polling task per worker, so an event reaches the index as soon as the worker logs it."""

    def __init__(self, pool: WorkerPool, sink: EventSink, client: UpstreamClient,
                 interval_s: float = 0.25, admin_key: str | None = None,
                 wait_s: float = DEFAULT_WAIT_S,
                 min_interval_s: float = DEFAULT_MIN_POLL_INTERVAL_S) -> None:
        self.pool, self.sink, self.client = pool, sink, client
        self.interval_s = interval_s  # the pause after an error or an early empty answer
        self.wait_s = wait_s
        self.min_interval_s = min_interval_s
        self.polls = 0
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.cursors: dict[str, int] = {}
        self.unsupported: set[str] = set()
        self.applied = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False

    async def poll_once(self) -> None:
        """One immediate read of every worker (start-up, tests)."""
        await asyncio.gather(*(self._poll(url, 0.0) for url in self.pool.workers
                               if url not in self.unsupported))

    def start(self) -> None:
        self._started = True
        for url in self.pool.workers:
            self.follow(url)

    def follow(self, url: str) -> None:
        """Follow a worker that joined the fleet (once started; `start` follows the rest)."""
        if self._started and url not in self._tasks:
            self._tasks[url] = asyncio.create_task(self._follow(url))

    def unfollow(self, url: str) -> None:
        """The worker left the fleet: stop polling it and forget its cursor."""
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self.cursors.pop(url, None)
        self.unsupported.discard(url)

    async def stop(self) -> None:
        self._started = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, url: str) -> None:
        while url not in self.unsupported:
            started = time.monotonic()
            applied = await self._poll(url, self.wait_s)
            # A worker down, or one that answers at once without waiting (an older kvserve):
            # pause, so a dead or non-waiting worker is not polled in a tight loop.
            elapsed = time.monotonic() - started
            if applied is None or (applied == 0 and elapsed < self.interval_s):
                await asyncio.sleep(self.interval_s)
            elif elapsed < self.min_interval_s:  # events came at once: let the next ones batch
                await asyncio.sleep(self.min_interval_s - elapsed)

    async def _poll(self, url: str, wait_s: float) -> int | None:
        """Apply the worker's next page of events; how many, or None if it could not be read."""
        after = self.cursors.get(url, 0)
        self.polls += 1
        try:
            resp = await self.client.get(f"{url}{EVENTS_PATH}?after={after}&wait={wait_s}",
                                         self.headers, wait_s + 2.0)
            body = await resp.aread()
        except UpstreamError:
            return None  # down: the scraper ejects it; its cursor stays for when it is back
        if resp.status_code == 404:
            self.unsupported.add(url)
            return None
        if resp.status_code != 200:
            return None
        try:
            page = json.loads(body)
            applied = apply_page(self.sink, url, page["events"], bool(page.get("gap")))
            self.cursors[url] = int(page["next_seq"])
        except (ValueError, KeyError, TypeError):
            self.unsupported.add(url)  # not kvserve's event format: stop following it
            return None
        self.applied += applied
        return applied
