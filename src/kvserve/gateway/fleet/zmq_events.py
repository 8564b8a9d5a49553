"""Follows workers' KV events over ZMQ (vLLM's wire, `kvserve.kvevents`) into the `precise`
policy: one subscriber for vLLM and kvserve workers alike.

Per worker and data-parallel rank, a SUB socket on the worker's publisher (bound where the
publisher connects, `kvevents.config.subscriber_address`) and, when the worker has a replay
endpoint, a DEALER to it. Batches are applied in sequence order. The worker's index is unknown
(`PrecisePolicy.set_synced(worker, False)`) from the start until a replay from seq 0 has been
applied (a late joiner learns what was published before it came), after a gap until the
missing batches are replayed, and after a restart (the sequence starts again) until the
restarted publisher's history is in. A replay that cannot give everything (its buffer rolled
over, or no replay endpoint) leaves the index partial: it is synced anyway, and logged.

Workers come and go (discovery): `follow`/`unfollow` attach and detach one. A worker with no
event source publishes nothing this gateway can read: it is routed by the prefixes the gateway
sent it alone, and a warning says once which flag would fix that. What is counted per worker
(`kv_event_metrics.py`) is exported on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import zmq
import zmq.asyncio

from kvserve.gateway.core.adapters import AdapterCatalog
from kvserve.gateway.fleet.event_index import EventSink, WorkerIndexFeed
from kvserve.gateway.fleet.kv_event_metrics import ReplayOutcome, ResyncReason, WorkerEventStats
from kvserve.gateway.fleet.kv_event_source import EventSource
from kvserve.kvevents.config import rank_endpoint, subscriber_address
from kvserve.kvevents.wire import (
    END_OF_REPLAY_SEQ,
    AllCleared,
    EventMessage,
    RemovedBlocks,
    StoredBlocks,
    WireError,
    decode_message,
    decode_seq,
)

log = logging.getLogger(__name__)

SUBSCRIPTION_SETTLE_S = 0.5  # after a join, when the follow-up replay runs
DEFAULT_REPLAY_TIMEOUT_S = 2.0
EVENT_TYPES = {StoredBlocks: "stored", RemovedBlocks: "removed", AllCleared: "cleared"}


class _Stream:
    """One rank's sequence: what was applied, and whether a replay's duplicates are expected."""

    def __init__(self, stats: WorkerEventStats) -> None:
        self.next_seq: int | None = None  # None: nothing applied yet
        self.replayed_from: int | None = None  # live duplicates of a replay may follow
        self.stats = stats  # the worker's, shared by its ranks


class ZmqEventFollower:
    """Subscribes to the workers it is told to follow and applies their batches to `policy`
    (see the module doc). A worker's source is `sources[url]`, else `default`. `model_id(url)`
    resolves the worker's served model name (the first block's key folds it in); it is retried
    until it answers."""

    def __init__(self, sources: dict[str, EventSource], policy: EventSink,
                 model_id: Callable[[str], Awaitable[str | None]],
                 replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
                 retry_interval_s: float = 1.0, block_size: int | None = None,
                 default: EventSource | None = None,
                 adapters: AdapterCatalog | None = None) -> None:
        self.sources, self.policy, self.model_id = sources, policy, model_id
        self.adapters = adapters  # learns adapters' digests from kvserve workers' events
        self.default = default
        self.block_size = block_size
        self.replay_timeout_s, self.retry_interval_s = replay_timeout_s, retry_interval_s
        self.feeds: dict[str, WorkerIndexFeed] = {}
        self.stats: dict[str, WorkerEventStats] = {}  # per followed worker
        self.silent: set[str] = set()  # workers with no source: nothing to follow
        self.num_batches = 0
        self.partial: set[str] = set()
        self._warned: set[str] = set()
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._started = False

    @property
    def num_gaps(self) -> int:
        return sum(s.gaps for s in self.stats.values())

    @property
    def num_restarts(self) -> int:
        return sum(s.resyncs[ResyncReason.RESTART] for s in self.stats.values())

    @property
    def num_replays(self) -> int:
        return sum(s.replays.total() for s in self.stats.values())

    @property
    def num_malformed(self) -> int:
        return sum(s.malformed for s in self.stats.values())

    def is_synced(self, url: str) -> bool:
        return self.policy.is_synced(url)

    def start(self, urls: Iterable[str] | None = None) -> None:
        """Follow `urls` (default: every worker `sources` names), and from now on every worker
        `follow` is given."""
        self._started = True
        for url in (self.sources if urls is None else urls):
            self.follow(url)

    def follow(self, url: str) -> None:
        """Attach to the worker's publisher (once started; a worker that joined the fleet)."""
        if not self._started or url in self._tasks or url in self.silent:
            return
        source = self.sources.get(url, self.default)
        if source is None:
            self.silent.add(url)
            if url not in self._warned:
                self._warned.add(url)
                log.warning("kvserve gateway: --policy precise has no KV events from %s, so it "
                            "routes there only by the prefixes it sent (blind to evictions and "
                            "to other routers' requests). Start the worker with "
                            "--kv-events-config '{\"enable_kv_cache_events\": true, "
                            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                            "\"replay_endpoint\": \"tcp://*:5558\"}' and give the gateway "
                            "--worker-kv-events %s=tcp://*:5557,replay=tcp://*:5558 (or, for "
                            "every worker alike, --worker-kv-events "
                            "tcp://*:5557,replay=tcp://*:5558)", url, url)
            return
        self.stats[url] = stats = WorkerEventStats()
        self.policy.set_synced(url, False)
        self._ready[url] = asyncio.Event()
        self._tasks[url] = [asyncio.create_task(self._follow(url, source, rank, stats))
                            for rank in range(source.dp_size)]

    def unfollow(self, url: str) -> None:
        """The worker left the fleet: detach from it and forget its index state and series."""
        for task in self._tasks.pop(url, []):
            task.cancel()
        self.stats.pop(url, None)
        self.feeds.pop(url, None)
        self._ready.pop(url, None)
        self.partial.discard(url)
        self.silent.discard(url)
        self.policy.set_synced(url, True)  # no longer "unknown": not a worker at all

    async def wait_subscribed(self, timeout_s: float) -> None:
        """Until every worker's stream is synced a first time (its publisher connected, its
        replay applied: a batch published from then on arrives), or the timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._ready.values())),
                                   timeout_s)

    async def stop(self) -> None:
        self._started = False
        tasks = [task for tasks in self._tasks.values() for task in tasks]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)

    def state(self, url: str) -> dict[str, object] | None:
        """What /workers shows of the worker's event stream (None: it is not followed)."""
        if url not in self.stats:
            return None
        feed = self.feeds.get(url)
        return {"source": "zmq", "synced": self.policy.is_synced(url),
                "partial": url in self.partial,
                "blocks_by_tier": feed.blocks_by_tier() if feed is not None else {},
                "orphan_blocks": feed.num_orphans if feed is not None else 0}

    async def _feed(self, url: str) -> WorkerIndexFeed:
        warned = False
        while url not in self.feeds:
            model = await self.model_id(url)
            if model is not None and url not in self.feeds:
                self.feeds[url] = WorkerIndexFeed(self.policy, url, model, self.block_size,
                                                  self.adapters)
            elif model is None:
                if not warned:
                    warned = True
                    log.warning("kvserve gateway: cannot read %s/v1/models (the model id keys "
                                "its blocks); its KV events are followed once it answers", url)
                await asyncio.sleep(self.retry_interval_s)
        return self.feeds[url]

    async def _follow(self, url: str, source: EventSource, rank: int,
                      stats: WorkerEventStats) -> None:
        feed = await self._feed(url)
        host = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        address, bind = subscriber_address(rank_endpoint(source.endpoint, rank), host)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        # A PUB drops what it sends before a subscriber's subscription reaches it (ZMQ's slow
        # joiner), and says nothing. So the replay that makes the index whole is asked for only
        # once the publisher's connection is up (its handshake, which the subscription follows
        # on the same connection), and again after each reconnection.
        joined = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        (sub.bind if bind else sub.connect)(address)
        replay = None
        if source.replay_endpoint is not None:
            replay = subscriber_address(rank_endpoint(source.replay_endpoint, rank), host)[0]
        stream = _Stream(stats)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(joined, zmq.POLLIN)
        try:
            if await joined.poll(int(self.replay_timeout_s * 1000)):  # else: replayed on join
                await joined.recv_multipart()
            stats.resyncs[ResyncReason.JOIN] += 1
            await self._resync(url, feed, stream, rank, replay, None)  # what came before us
            if url in self._ready:  # synced: what is published from now on arrives
                self._ready[url].set()
            # The handshake can precede the publisher's reading of the subscription: a batch
            # sent in between is dropped with nothing after it to reveal the gap. One more
            # replay once the subscription has surely landed recovers it.
            settle_at = None if replay is None else time.monotonic() + SUBSCRIPTION_SETTLE_S
            while True:
                wait_ms = (None if settle_at is None
                           else max(0, int((settle_at - time.monotonic()) * 1000)))
                ready = dict(await poller.poll(wait_ms))
                if settle_at is not None and time.monotonic() >= settle_at:
                    settle_at = None
                    await self._resync(url, feed, stream, rank, replay, None)
                if joined in ready:  # (re)connected: what it sent meanwhile was dropped
                    await joined.recv_multipart()
                    if replay is not None:
                        stats.resyncs[ResyncReason.JOIN] += 1
                        await self._resync(url, feed, stream, rank, replay, None)
                        settle_at = time.monotonic() + SUBSCRIPTION_SETTLE_S
                if sub in ready:
                    message = self._decode(url, stream, await sub.recv_multipart())
                    if message is not None:
                        await self._on_message(url, feed, stream, rank, replay, message)
        finally:
            sub.disable_monitor()
            joined.close(0)
            sub.close(0)

    def _decode(self, url: str, stream: _Stream, frames: list[bytes]) -> EventMessage | None:
        try:
            return decode_message(frames)
        except WireError as exc:
            stream.stats.malformed += 1
            log.warning("kvserve gateway: a KV-event message from %s is malformed (%s); "
                        "skipped", url, exc)
            return None

    async def _on_message(self, url: str, feed: WorkerIndexFeed, stream: _Stream, rank: int,
                          replay: str | None, message: EventMessage) -> None:
        # Invariant: batches reach the feed in sequence order, each at most once.
        seq, expected = message.seq, stream.next_seq
        if seq == expected or (expected is None and seq == 0):
            self._apply(feed, stream, rank, message)
            return
        if expected is not None and seq < expected:
            if stream.replayed_from is not None and seq >= stream.replayed_from:
                return  # a live copy of a batch the replay already gave
            stream.stats.resyncs[ResyncReason.RESTART] += 1
            log.info("kvserve gateway: %s's KV-event publisher restarted (seq %d after %d); "
                     "resynchronising", url, seq, expected - 1)
            feed.clear_rank(rank)
            stream.next_seq, stream.replayed_from = 0, None
            if seq == 0:
                self._apply(feed, stream, rank, message)
                self.policy.set_synced(url, True)
                return
        else:
            stream.stats.gaps += 1
            stream.stats.resyncs[ResyncReason.GAP] += 1
        await self._resync(url, feed, stream, rank, replay, message)

    def _apply(self, feed: WorkerIndexFeed, stream: _Stream, rank: int, message: EventMessage,
               live: bool = True) -> None:
        feed.apply(message.events, rank)
        for event in message.events:
            stream.stats.events[EVENT_TYPES[type(event)]] += 1
        stream.next_seq = message.seq + 1
        self.num_batches += 1
        if live:  # the live stream has caught up with the replay: no duplicates follow
            stream.replayed_from = None

    async def _resync(self, url: str, feed: WorkerIndexFeed, stream: _Stream, rank: int,
                      replay: str | None, waiting: EventMessage | None) -> None:
        """Replay from the next expected seq (0 at first), then apply `waiting` (the live
        batch that revealed the gap) if the replay did not cover it."""
        self.policy.set_synced(url, False)
        start = stream.next_seq or 0
        complete = False
        if replay is not None:
            outcome = await self._replay(url, feed, stream, rank, replay, start)
            stream.stats.replays[outcome] += 1
            complete = outcome is ReplayOutcome.COMPLETE
        if waiting is not None and (stream.next_seq is None or waiting.seq >= stream.next_seq):
            if stream.next_seq is not None and waiting.seq > stream.next_seq:
                complete = False
            self._apply(feed, stream, rank, waiting)
        if waiting is None and replay is None:
            complete = True  # nothing to replay from: the stream is followed from here on
        if complete:
            self.partial.discard(url)
        else:
            self.partial.add(url)
            log.warning("kvserve gateway: %s's KV events from seq %d could not all be "
                        "replayed%s; its index misses what they stored", url, start,
                        "" if replay else " (give its replay endpoint: ,replay=ENDPOINT)")
        self.policy.set_synced(url, True)

    async def _replay(self, url: str, feed: WorkerIndexFeed, stream: _Stream, rank: int,
                      replay: str, start: int) -> ReplayOutcome:
        """Apply the publisher's buffered batches from `start`; whether it had them all."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        complete, first = True, True
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("kvserve gateway: %s's replay endpoint %s did not answer "
                                "within %.1f s", url, replay, self.replay_timeout_s)
                    return ReplayOutcome.TIMEOUT
                frames = (await dealer.recv_multipart())[1:]  # after the empty delimiter
                if len(frames) == 3 and decode_seq(frames[1]) == END_OF_REPLAY_SEQ:
                    return ReplayOutcome.COMPLETE if complete else ReplayOutcome.PARTIAL
                message = self._decode(url, stream, frames)
                if message is None:
                    complete = False
                    continue
                if first and message.seq > start:
                    complete = False  # the buffer no longer holds the oldest batches
                first = False
                if stream.next_seq is None or message.seq >= stream.next_seq:
                    stream.replayed_from = start
                    self._apply(feed, stream, rank, message, live=False)
        finally:
            dealer.close(0)
