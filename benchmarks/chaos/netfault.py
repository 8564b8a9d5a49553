"""A fault-injecting TCP proxy of the harness's own, on loopback: the gateway reaches a worker
(and a worker's KV-event publisher reaches the gateway) through one, so a fault lies between
exactly those two. `delay_s` adds latency to every chunk each way; `partition` blackholes the
link (new connections are accepted and hang, bytes in flight are held: a silent network, not a
refusal); `cut` resets every open connection once (a dropped link: what was in flight is lost).

Why not network namespaces and `tc netem` (the issue's first choice): this machine's kernel has
no netem (`# CONFIG_NET_SCH_NETEM is not set`, no /lib/modules; `tc qdisc add dev lo root netem
delay 10ms` in a fresh namespace: "Specified qdisc kind is unknown"), and no iptables or nft
binary for a silent drop; namespaces alone work (as root) but cannot delay or blackhole. A proxy
also confines the fault to exactly one link, which netem on a worker's veth would not (the
harness's own scrapes would cross it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class FaultProxy:
    """Listens on `listen_port` (127.0.0.1) and forwards to `target_port`; runs its own loop in
    a daemon thread. Faults are set from any thread."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port, self.target_port = listen_port, target_port
        self.delay_s = 0.0
        self.partitioned = threading.Event()
        self._conns: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"proxy-{listen_port}")
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError(f"proxy on {listen_port} did not start")

    def cut(self) -> int:
        """Reset every open connection; how many there were."""
        conns = list(self._conns)
        for writer in conns:
            self._loop.call_soon_threadsafe(_abort, writer)
        return len(conns)

    def partition(self, on: bool) -> None:
        if on:
            self.partitioned.set()
        else:
            self.partitioned.clear()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.listen_port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._conns):
                _abort(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while self.partitioned.is_set():  # the SYN was answered; nothing else is
                await asyncio.sleep(0.05)
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.target_port), 10.0)
            except (OSError, TimeoutError):
                _abort(writer)
                return
            self._conns.add(up_writer)
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                                 return_exceptions=True)
            self._conns.discard(up_writer)
        finally:
            self._conns.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                while self.partitioned.is_set():
                    await asyncio.sleep(0.05)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.transport.abort()
