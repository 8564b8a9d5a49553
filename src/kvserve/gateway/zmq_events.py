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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvserve.gateway.event_index import WorkerIndexFeed
from kvserve.gateway.policies import PrecisePolicy
from kvserve.kvevents.config import check_endpoint, rank_endpoint, subscriber_address
from kvserve.kvevents.wire import (
    END_OF_REPLAY_SEQ,
    EventMessage,
    WireError,
    decode_message,
    decode_seq,
)

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker publishes: its `--kv-events-config` endpoint and replay endpoint as the
    worker was given them, its topic and its number of data-parallel ranks."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1

    @classmethod
    def parse(cls, spec: str) -> tuple[str, EventSource]:
        """`URL=ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N]` (the flag's form) -> (url, source);
        ValueError saying the expected form."""
        url, sep, rest = spec.partition("=")
        form = ("expected URL=ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N], e.g. "
                "http://10.0.0.5:8000=tcp://*:5557,replay=tcp://*:5558")
        if not sep or not url.startswith(("http://", "https://")) or not rest:
            raise ValueError(f"--worker-kv-events {spec!r}: {form}")
        endpoint, *options = rest.split(",")
        check_endpoint(endpoint)
        values: dict[str, str] = {}
        for option in options:
            name, eq, value = option.partition("=")
            if not eq or name not in ("replay", "topic", "dp"):
                raise ValueError(f"--worker-kv-events {spec!r}: unknown option {option!r}; "
                                 f"{form}")
            values[name] = value
        replay = values.get("replay")
        if replay is not None:
            check_endpoint(replay)
        dp = values.get("dp", "1")
        if not dp.isdigit() or int(dp) < 1:
            raise ValueError(f"--worker-kv-events {spec!r}: dp must be an integer >= 1")
        return url.rstrip("/"), cls(endpoint, replay, values.get("topic", ""), int(dp))


class _Stream:
    """One rank's sequence: what was applied, and whether a replay's duplicates are expected."""

    def __init__(self) -> None:
        self.next_seq: int | None = None  # None: nothing applied yet
        self.replayed_from: int | None = None  # live duplicates of a replay may follow


class ZmqEventFollower:
    """Subscribes to every worker in `sources` (url -> EventSource) and applies their batches
    to `policy` (see the module doc). `model_id(url)` resolves the worker's served model name
    (the first block's key folds it in); it is retried until it answers."""

    def __init__(self, sources: dict[str, EventSource], policy: PrecisePolicy,
                 model_id: Callable[[str], Awaitable[str | None]],
                 replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
                 retry_interval_s: float = 1.0, block_size: int | None = None) -> None:
        self.sources, self.policy, self.model_id = sources, policy, model_id
        self.block_size = block_size
        self.replay_timeout_s, self.retry_interval_s = replay_timeout_s, retry_interval_s
        self.feeds: dict[str, WorkerIndexFeed] = {}
        self.num_batches = 0
        self.num_replays = 0
        self.num_gaps = 0
        self.num_restarts = 0
        self.num_malformed = 0
        self.partial: set[str] = set()
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: dict[str, asyncio.Event] = {}

    def start(self) -> None:
        for url, source in self.sources.items():
            self.policy.set_synced(url, False)
            self._ready[url] = asyncio.Event()
            self._tasks += [asyncio.create_task(self._follow(url, source, rank))
                            for rank in range(source.dp_size)]

    async def wait_subscribed(self, timeout_s: float) -> None:
        """Until every worker's sockets are attached (its model id resolved), or the timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self._ready.values())),
                                   timeout_s)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)

    def state(self, url: str) -> dict[str, object]:
        """What /workers shows of the worker's event stream."""
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
                self.feeds[url] = WorkerIndexFeed(self.policy, url, model, self.block_size)
            elif model is None:
                if not warned:
                    warned = True
                    log.warning("kvserve gateway: cannot read %s/v1/models (the model id keys "
                                "its blocks); its KV events are followed once it answers", url)
                await asyncio.sleep(self.retry_interval_s)
        return self.feeds[url]

    async def _follow(self, url: str, source: EventSource, rank: int) -> None:
        feed = await self._feed(url)
        host = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        address, bind = subscriber_address(rank_endpoint(source.endpoint, rank), host)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        (sub.bind if bind else sub.connect)(address)
        replay = None
        if source.replay_endpoint is not None:
            replay = subscriber_address(rank_endpoint(source.replay_endpoint, rank), host)[0]
        self._ready[url].set()
        stream = _Stream()
        try:
            await self._resync(url, feed, stream, rank, replay, None)  # what came before us
            while True:
                frames = await sub.recv_multipart()
                message = self._decode(url, frames)
                if message is not None:
                    await self._on_message(url, feed, stream, rank, replay, message)
        finally:
            sub.close(0)

    def _decode(self, url: str, frames: list[bytes]) -> EventMessage | None:
        try:
            return decode_message(frames)
        except WireError as exc:
            self.num_malformed += 1
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
            self.num_restarts += 1
            log.info("kvserve gateway: %s's KV-event publisher restarted (seq %d after %d); "
                     "resynchronising", url, seq, expected - 1)
            feed.clear_rank(rank)
            stream.next_seq, stream.replayed_from = 0, None
            if seq == 0:
                self._apply(feed, stream, rank, message)
                self.policy.set_synced(url, True)
                return
        else:
            self.num_gaps += 1
        await self._resync(url, feed, stream, rank, replay, message)

    def _apply(self, feed: WorkerIndexFeed, stream: _Stream, rank: int, message: EventMessage,
               live: bool = True) -> None:
        feed.apply(message.events, rank)
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
            complete = await self._replay(url, feed, stream, rank, replay, start)
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
                      replay: str, start: int) -> bool:
        """Apply the publisher's buffered batches from `start`; whether it had them all."""
        self.num_replays += 1
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
                    return False
                frames = (await dealer.recv_multipart())[1:]  # after the empty delimiter
                if len(frames) == 3 and decode_seq(frames[1]) == END_OF_REPLAY_SEQ:
                    return complete
                message = self._decode(url, frames)
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
