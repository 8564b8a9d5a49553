"""A real TCP proxy between a decode worker and a prefill worker that breaks what it carries.

It runs its own asyncio loop on a thread, on a free loopback port. A fault armed with `arm`
applies to the next HTTP request it sees (keep-alive connections carry several): cut the
connection after `offset` bytes of the request or of the response, stall the response for a
while, or flip one byte of the first KV frame's payload. No test hook lives in production
code: the workers just talk HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from kvserve.server.kv.frames import HEADER_BYTES, MAGIC
from tests.gateway.processes import free_port


@dataclass(frozen=True, slots=True)
class Cut:
    """Close both sides after `offset` bytes of the request (`upstream`) or of the response."""

    offset: int
    upstream: bool = False


@dataclass(frozen=True, slots=True)
class Flip:
    """XOR byte `offset` of the first KV frame's payload in the response with 0x01."""

    offset: int = 0


@dataclass(frozen=True, slots=True)
class Stall:
    """Hold the response for `seconds` after `offset` bytes of it (a slow network), then go on."""

    offset: int
    seconds: float


Fault = Cut | Flip | Stall


@dataclass(slots=True)
class _Exchange:
    fault: Fault | None = None
    sent: int = 0  # request bytes forwarded
    received: int = 0  # response bytes forwarded
    flipped: bool = False
    stalled: bool = False


class FaultyProxy:
    """Forwards 127.0.0.1:`port` to `target_port`; `url` is what the decode worker is given."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_faults_fired = 0
        self._armed: Fault | None = None
        self._armed_for: tuple[bytes, ...] = (b"POST ", b"GET ")
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(10.0)

    def arm(self, fault: Fault | None, methods: tuple[str, ...] = ("POST", "GET")) -> None:
        """`fault` for the next request of one of `methods` (POST only: a gateway's scrapes,
        which are GETs, pass unharmed)."""
        with self._lock:
            self._armed = fault
            self._armed_for = tuple(f"{m} ".encode() for m in methods)

    def close(self) -> None:
        async def shut() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shut(), self._loop)
        self._thread.join(5.0)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()
        server.close()

    def _fired(self) -> None:
        with self._lock:
            self.num_faults_fired += 1

    async def _handle(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        exchange = _Exchange()
        done = asyncio.Event()

        async def upstream() -> None:
            while not done.is_set() and (data := await client_r.read(65536)):
                if data.startswith((b"POST ", b"GET ")):
                    with self._lock:
                        fault = self._armed if data.startswith(self._armed_for) else None
                        if fault is not None:
                            self._armed = None
                    exchange.fault, exchange.sent, exchange.received = fault, 0, 0
                    exchange.flipped = exchange.stalled = False
                fault = exchange.fault
                if isinstance(fault, Cut) and fault.upstream and (
                        exchange.sent + len(data) > fault.offset):
                    server_w.write(data[:fault.offset - exchange.sent])
                    await server_w.drain()
                    self._fired()
                    done.set()
                    return
                exchange.sent += len(data)
                server_w.write(data)
                await server_w.drain()
            done.set()

        async def downstream() -> None:
            while not done.is_set() and (data := await server_r.read(65536)):
                fault = exchange.fault
                if isinstance(fault, Cut) and not fault.upstream and (
                        exchange.received + len(data) > fault.offset):
                    client_w.write(data[:fault.offset - exchange.received])
                    await client_w.drain()
                    self._fired()
                    done.set()
                    return
                if isinstance(fault, Stall) and not exchange.stalled and (
                        exchange.received + len(data) > fault.offset):
                    head = fault.offset - exchange.received
                    client_w.write(data[:head])
                    await client_w.drain()
                    exchange.stalled = True
                    self._fired()
                    await asyncio.sleep(fault.seconds)
                    exchange.received += head
                    data = data[head:]
                if isinstance(fault, Flip) and not exchange.flipped and MAGIC in data:
                    at = data.index(MAGIC) + HEADER_BYTES + fault.offset
                    if at < len(data):
                        data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
                        exchange.flipped = True
                        self._fired()
                exchange.received += len(data)
                client_w.write(data)
                await client_w.drain()
            done.set()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await done.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in (client_w, server_w):
            writer.close()
