"""A scripted KV-event publisher for the subscriber's tests: real ZMQ sockets (PUB, and a ROUTER
answering replays from its buffer as vLLM's does), with the test choosing which batches go out
live, which are only buffered (lost, or from before the subscriber came), and restarts."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from kvserve.kvevents.wire import WireEvent, encode_batch, encode_message

END = (-1).to_bytes(8, "big", signed=True)


class ScriptedPublisher:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay: str | None,
                 topic: str = "kv", bind: bool = True) -> None:
        self.topic = topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        (self.pub.bind if bind else self.pub.connect)(endpoint)
        self.router = None
        if replay is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays: list[int] = []
        self._task = asyncio.create_task(self._serve()) if self.router is not None else None

    async def batch(self, events: list[WireEvent], live: bool = True, rank: int = 0) -> int:
        """Publish (or, with live=False, only buffer) the next batch; its seq."""
        seq, payload = self.seq, encode_batch(1.0, events, rank)
        self.seq += 1
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart(encode_message(self.topic, seq, payload))
        return seq

    async def recorded(self, seq: int, payload: bytes, live: bool = True) -> None:
        """Publish (or only buffer) a recorded batch under its own seq."""
        self.buffer.append((seq, payload))
        self.seq = seq + 1
        if live:
            await self.pub.send_multipart(encode_message(self.topic, seq, payload))

    async def raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new process: the sequence starts at 0 again, with an empty buffer."""
        self.seq, self.buffer = 0, []

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            begin = int.from_bytes(start, "big")
            self.replays.append(begin)
            for seq, payload in list(self.buffer):
                if seq >= begin:
                    await self.router.send_multipart([client, b"", self.topic.encode(),
                                                      seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
