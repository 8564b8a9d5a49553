"""Stand-in workers on loopback ports: `loopback_workers` for tests of the gateway's own HTTP
client (which, unlike httpx, has no mock transport), `StalledWorker` for a gateway process in
front of a worker that never answers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable

Answer = tuple[int, str]
"""(status, body) of one response."""


@contextlib.asynccontextmanager
async def loopback_workers(count: int, answer: Callable[[str, str], Answer]
                           ) -> AsyncIterator[list[str]]:
    """`count` HTTP/1.1 servers with keep-alive; a GET of PATH from the one at URL gets
    `answer(URL, PATH)`. Yields their URLs; closes them on exit."""
    servers: list[asyncio.Server] = []

    def serve(url_of: Callable[[], str]) -> Callable[..., object]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    path = head.split(b" ", 2)[1].decode()
                    status, text = answer(url_of(), path)
                    body = text.encode()
                    writer.write(b"HTTP/1.1 %d X\r\nContent-Type: text/plain\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
                    await writer.drain()
            writer.close()
        return handle

    urls: list[str] = []
    try:
        for i in range(count):
            server = await asyncio.start_server(serve(lambda i=i: urls[i]), "127.0.0.1", 0)
            servers.append(server)
            urls.append(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        yield urls
    finally:
        for server in servers:
            server.close()


class StalledWorker:
    """A worker that is up (/health, /metrics) but never answers a POST: it takes the request
    and waits for the caller to close the connection, recording when it did, as a worker with
    a long queue would before its first token. Runs its own event loop in a thread, for tests
    of a gateway process in front of it."""

    def __init__(self) -> None:
        self.posts = 0
        self.closed_at: list[float] = []  # time.monotonic() of each POST's connection closing
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.url = ""

    def __enter__(self) -> StalledWorker:
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError("the stalled worker did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                if method == b"POST":
                    self.posts += 1
                    while await reader.read(65536):  # the body, then nothing until EOF
                        pass
                    self.closed_at.append(time.monotonic())
                    break
                body = b"ok" if path == b"/health" else b""
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()
