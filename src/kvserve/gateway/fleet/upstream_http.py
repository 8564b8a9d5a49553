"""A lean HTTP/1.1 client for the gateway's hot path: one POST upstream, its body streamed back
(and the periodic GETs: metric scrapes).

Why not httpx here: its connection pool scans every pooled connection (polling each socket) on
every request, so the gateway's cost per request grew with its concurrency; at 64 concurrent
streams that scan was a third of the gateway's CPU. This client keeps a LIFO list of idle
keep-alive connections per worker (O(1) to take or return one), parses with httptools (the
parser uvicorn uses) and writes straight to the asyncio transport. httpx stays for everything
that is neither per request nor periodic (/v1/models, at start-up and when asked).

Contracts:
- `UpstreamClient.post` returns once the status line and headers arrived; the body is then read
  with `aread` or `aiter_raw`, and `aclose` must be called once (idempotent). A connection goes
  back to the pool only after its whole response was read and the worker allowed keep-alive;
  closing early closes the socket, which the worker sees as a client disconnect.
- A pooled connection the worker closed while idle is detected before reuse; one that fails
  before any response byte is retried once on a fresh connection (no response byte means the
  worker saw a disconnect, not a request it answered).
- Every failure is an `UpstreamError` subclass named like httpx's (ConnectError, ReadTimeout,
  RemoteProtocolError), so logs and /workers read the same.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

MAX_BUFFERED_BYTES = 1 << 20  # stop reading from a worker whose client is this far behind
MAX_IDLE_PER_WORKER = 256


class UpstreamError(Exception):
    """The worker could not be reached or broke the HTTP exchange."""


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    """The worker closed the connection mid-response or sent something that is not HTTP."""


class _Connection(asyncio.Protocol):
    """One socket to a worker; serves one exchange at a time."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the socket is gone or going: never reuse
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[str, str] = {}
        self.status = 0
        self.keep_alive = False
        self.received_any = False
        self.complete = False
        self.error: UpstreamError | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("the worker upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(RemoteProtocolError(f"the worker sent invalid HTTP: {exc}"))

    def eof_received(self) -> bool:
        self.closed = True
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            reason = f": {exc}" if exc else ""
            self._fail(RemoteProtocolError(f"the worker closed the connection{reason}"))

    def pause_writing(self) -> None:  # requests are small; nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- internals -----------------------------------------------------------------------------

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.closed = True
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved: no "never retrieved" warning
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The body's bytes that arrived since the last call (all of them, joined: one write
        downstream instead of one per piece), or None at its end. Raises the exchange's error,
        or ReadTimeout after `timeout` seconds without data."""
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            # A timer, not asyncio.wait_for: this runs once per streamed token, and wait_for
            # costs a task's worth of futures and callbacks each time.
            timer = (loop.call_later(timeout, _expire, waiter, timeout)
                     if timeout is not None else None)
            try:
                await waiter
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()
        chunk = b"".join(self.chunks)
        self.chunks.clear()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= MAX_BUFFERED_BYTES // 2 and self.transport:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"no data from the worker for {timeout}s"))


class UpstreamResponse:
    """An open response: status and headers now, the body as it arrives."""

    def __init__(self, client: UpstreamClient, conn: _Connection, read_timeout: float | None):
        self._client = client
        self._conn = conn
        self._read_timeout = read_timeout
        self._closed = False
        self.status_code = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes (de-chunked) as they arrive; the end of the body ends the loop."""
        while True:
            chunk = await self._conn.next_chunk(self._read_timeout)
            if chunk is None:
                return
            yield chunk

    async def aread(self) -> bytes:
        try:
            return b"".join([chunk async for chunk in self.aiter_raw()])
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            self._client._release(conn)
        else:
            conn.close()


class UpstreamClient:
    """Pooled HTTP/1.1 connections to the workers, one idle list per (scheme, host, port)."""

    def __init__(self, connect_timeout_s: float = 5.0,
                 max_idle_per_worker: int = MAX_IDLE_PER_WORKER) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_worker = max_idle_per_worker
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   read_timeout_s: float | None) -> UpstreamResponse:
        """POST `body` (JSON) to `url` and wait for the response's headers."""
        return await self._request("POST", url, body, headers, read_timeout_s)

    async def get(self, url: str, headers: Mapping[str, str],
                  read_timeout_s: float | None) -> UpstreamResponse:
        """GET `url` (query included) and wait for the response's headers."""
        return await self._request("GET", url, None, headers, read_timeout_s)

    async def _request(self, method: str, url: str, body: bytes | None,
                       headers: Mapping[str, str],
                       read_timeout_s: float | None) -> UpstreamResponse:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        key = (parts.scheme, parts.hostname, port)
        target = parts.path or "/"
        if parts.query:
            target += f"?{parts.query}"
        head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} contains a line break")
            head.append(f"{name}: {value}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        conn, reused = self._take_idle(key), True
        if conn is None:
            conn, reused = await self._connect(key), False
        try:
            return await self._exchange(conn, request, read_timeout_s)
        except RemoteProtocolError:
            if not reused or conn.received_any:
                raise
        # The worker had closed this idle connection as we sent: once more, on a new one.
        return await self._exchange(await self._connect(key), request, read_timeout_s)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _exchange(self, conn: _Connection, request: bytes,
                        read_timeout_s: float | None) -> UpstreamResponse:
        assert conn.transport is not None
        conn._reset()
        try:
            conn.transport.write(request)
            await asyncio.wait_for(asyncio.shield(conn.headers_done), read_timeout_s)
        except TimeoutError:
            conn.close()
            raise ReadTimeout(f"the worker sent no response headers in {read_timeout_s}s") \
                from None
        except BaseException:
            conn.close()  # cancelled or failed: the exchange is unusable
            raise
        return UpstreamResponse(self, conn, read_timeout_s)

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(key), host, port, ssl=context),
                self.connect_timeout_s)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} in "
                                 f"{self.connect_timeout_s}s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()  # LIFO: the warmest socket, and idle ones age out at the worker
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _release(self, conn: _Connection) -> None:
        conns = self._idle.setdefault(conn.key, [])
        if len(conns) >= self.max_idle_per_worker:
            conn.close()
        else:
            conns.append(conn)
