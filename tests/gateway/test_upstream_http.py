"""The gateway's upstream HTTP client against scripted loopback servers: framing, streaming,
keep-alive reuse, a worker that closed an idle connection, and each way an exchange can fail."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvserve.gateway.fleet.upstream_http import (
    ConnectError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamClient,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (Content-Length framed, as the client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


class Server:
    """A loopback server running `handler(reader, writer, connection_number)` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20.0))


def test_keep_alive_reuses_one_connection_and_sends_the_body_and_headers() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            request = await read_request(reader)
            server.requests.append(request)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 11\r\n\r\n{\"ok\":true}")
            await writer.drain()

    async def scenario() -> None:
        client = UpstreamClient()
        for _ in range(3):
            response = await client.post(server.url, b'{"prompt":"x"}',
                                         {"x-request-id": "r1"}, 5.0)
            assert response.status_code == 200
            assert response.headers["content-type"] == "application/json"
            assert await response.aread() == b'{"ok":true}'
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"x-request-id: r1\r\n" in server.requests[0]
        assert server.requests[0].endswith(b'\r\n\r\n{"prompt":"x"}')
        await client.aclose()

    server = Server(handler)

    async def main() -> None:
        async with server:
            await scenario()

    run(main)


def test_a_chunked_stream_arrives_piece_by_piece_not_buffered() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await release.wait()  # the client must see the first chunk before the rest exists
        writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the socket open until the client closes it

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            response = await client.post(server.url, b"{}", {}, 5.0)
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"data: "
            release.set()
            assert [c async for c in chunks] == [b"hello"]
            await response.aclose()
            await client.aclose()

    run(main)


def test_pieces_that_arrived_together_come_out_as_one_in_order() -> None:
    """A relay writes what it reads: pieces already buffered are joined, so a busy gateway
    makes one write downstream per wake-up, not one per token."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + b"".join(b"3\r\nt%02d\r\n" % i for i in range(20)) + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            response = await client.post(server.url, b"{}", {}, 5.0)
            await asyncio.sleep(0.2)  # all twenty pieces are in the buffer by now
            pieces = [c async for c in response.aiter_raw()]
            assert b"".join(pieces) == b"".join(b"t%02d" % i for i in range(20))
            assert len(pieces) < 20, pieces
            await client.aclose()

    run(main)


def test_a_stream_silent_past_the_read_timeout_is_a_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        server.requests.append(await reader.read())  # then nothing, until the client closes

    async def main() -> None:
        async with server:
            client = UpstreamClient()
            response = await client.post(server.url, b"{}", {}, 0.3)
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"data: "
            started = asyncio.get_running_loop().time()
            with pytest.raises(ReadTimeout, match=r"no data from the worker for 0\.3s"):
                await chunks.__anext__()
            assert 0.25 < asyncio.get_running_loop().time() - started < 3.0
            await response.aclose()  # a timed-out exchange is not reused: its socket closes
            for _ in range(100):
                if server.requests:
                    break
                await asyncio.sleep(0.02)
            assert server.requests == [b""]
            await client.aclose()

    server = Server(handler)
    run(main)


def test_an_idle_connection_the_worker_closed_is_replaced_not_failed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # then close the kept-alive connection while the client holds it idle

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            for _ in range(3):
                response = await client.post(server.url, b"{}", {}, 5.0)
                assert await response.aread() == b"ok"
                await asyncio.sleep(0.05)  # the close reaches the client's idle socket
            assert server.connections == 3
            await client.aclose()

    run(main)


def test_a_body_cut_short_is_a_protocol_error_and_the_socket_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      number: int) -> None:
        await read_request(reader)
        if number == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
            await writer.drain()
            return  # closes mid-body
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            response = await client.post(server.url, b"{}", {}, 5.0)
            with pytest.raises(RemoteProtocolError, match="closed the connection"):
                await response.aread()
            response = await client.post(server.url, b"{}", {}, 5.0)
            assert await response.aread() == b"ok"
            assert server.connections == 2
            await client.aclose()

    run(main)


def test_closing_a_response_early_closes_the_socket() -> None:
    saw_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        assert await reader.read() == b""  # the client went away: a worker aborts here
        saw_eof.set()

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            response = await client.post(server.url, b"{}", {}, 5.0)
            assert await response.aiter_raw().__anext__() == b"a"
            await response.aclose()
            await asyncio.wait_for(saw_eof.wait(), 5.0)
            await client.aclose()

    run(main)


def test_connection_close_responses_are_not_pooled() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            for _ in range(2):
                response = await client.post(server.url, b"{}", {}, 5.0)
                assert await response.aread() == b"ok"
            assert server.connections == 2
            await client.aclose()

    run(main)


def test_failures_are_named_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await reader.read()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        client = UpstreamClient(connect_timeout_s=2.0)
        async with Server(silent) as server:
            dead_url = server.url
            with pytest.raises(ReadTimeout, match="no response headers"):
                await client.post(server.url, b"{}", {}, 0.3)
        with pytest.raises(ConnectError, match="cannot connect"):
            await client.post(dead_url, b"{}", {}, 1.0)
        async with Server(garbage) as server:
            with pytest.raises(RemoteProtocolError, match="invalid HTTP"):
                await client.post(server.url, b"{}", {}, 5.0)
        with pytest.raises(ConnectError, match="not an http"):
            await client.post("unix:///tmp/x", b"{}", {}, 1.0)
        with pytest.raises(ValueError, match="line break"):
            await client.post(dead_url, b"{}", {"x-request-id": "a\r\nx-evil: 1"}, 1.0)
        await client.aclose()

    run(main)


def test_a_reused_connection_dropped_before_any_answer_is_retried_once_on_a_new_one() -> None:
    """The race the idle check cannot see: the worker closes a kept-alive socket just as the
    next request goes out. Nothing was answered, so the client resends on a fresh connection;
    a fresh connection that drops unanswered is an error (it would drop again)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      number: int) -> None:
        await read_request(reader)
        if number >= 3:
            return  # connection 3 and later: drop every request unanswered
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)  # connection 1's second request: dropped unanswered

    async def main() -> None:
        async with Server(handler) as server:
            client = UpstreamClient()
            for expected_connections in (1, 2):
                response = await client.post(server.url, b"{}", {}, 5.0)
                assert await response.aread() == b"ok"
                assert server.connections == expected_connections
            with pytest.raises(RemoteProtocolError):  # reused conn 2 drops, then fresh conn 3
                await client.post(server.url, b"{}", {}, 5.0)
            assert server.connections == 3
            await client.aclose()

    run(main)
