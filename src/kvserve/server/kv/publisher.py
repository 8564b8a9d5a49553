"""Publishes a worker's KV events on vLLM's wire (`kvserve serve --kv-events-config`), so one
subscriber follows kvserve and vLLM workers alike, and so can external indexers.

The engine thread hands each step's events to `publish` (via `KVEventLog.set_publisher`); a
thread of its own owns the ZMQ sockets (they are not thread-safe): it sends each step's batch as
(topic, seq, msgpack) on the PUB socket, keeps the last `buffer_steps` batches, and answers the
ROUTER replay endpoint ("everything from seq N", then an end marker) as vLLM does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kvevents.config import KVEventsConfig, is_bind_endpoint
from kvserve.kvevents.wire import (
    MEDIUM_GPU,
    AllCleared,
    RemovedBlocks,
    StoredBlocks,
    WireEvent,
    adapter_extra_key,
    encode_batch,
    encode_message,
)

log = logging.getLogger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def wire_event(event: KVEvent,
               adapter_name: Callable[[bytes], str | None] | None = None) -> WireEvent:
    """kvserve's event as vLLM names it; a first block carries its extra keys as vLLM's do:
    the LoRA adapter first (kvserve: its digest, `kvevents.wire.adapter_extra_key`), then the
    cache salt. `lora_name` is the adapter's name (`adapter_name(digest)`), for people and
    for routers that want it; the digest is the identity."""
    if isinstance(event, BlockStored):
        extra = None
        keys: tuple[str, ...] = ()
        if event.adapter_digest is not None:
            keys += (adapter_extra_key(event.adapter_digest),)
        if event.cache_salt:
            keys += (event.cache_salt,)
        if event.parent_block_hash is None and keys:
            extra = (keys,) + (None,) * (len(event.block_hashes) - 1)
        name = None
        if event.adapter_digest is not None:
            name = (adapter_name(event.adapter_digest) if adapter_name is not None
                    else None) or event.adapter_digest.hex()[:16]
        return StoredBlocks(event.block_hashes, event.parent_block_hash, event.token_ids,
                            event.block_size, MEDIUM_GPU, name, extra)
    if isinstance(event, BlockRemoved):
        return RemovedBlocks(event.block_hashes, MEDIUM_GPU)
    if isinstance(event, AllBlocksCleared):
        return AllCleared()
    raise TypeError(f"not a KV event: {event!r}")


class ZmqKVEventPublisher:
    """Started by the constructor (sockets bound or connected at once, so a bad endpoint fails
    start-up); `close()` stops the thread after sending what is queued."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        self.config, self.rank = config, rank
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint!r} / "
                             f"{config.replay_endpoint!r}: {exc}") from exc
        self.num_dropped = 0
        # digest -> the LoRA adapter's name, for events' `lora_name` (set by the app; None: no LoRA)
        self.adapter_names: Callable[[bytes], str | None] | None = None
        self._topic = config.topic
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one engine step's events as one batch (from the engine thread; never blocks:
        a full queue drops the batch, which a subscriber sees as a gap)."""
        payload = encode_batch(time.time(), [wire_event(e, self.adapter_names) for e in events],
                               self.rank)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            self._pub.send_multipart(encode_message(self._topic, seq, payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kvserve: a KV-event replay request of %d frames ignored", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        topic = self._topic.encode()
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"),
                                             payload])
        self._replay.send_multipart([client, b"", b"", _END_OF_REPLAY, b""])
