"""A lean blocking reader of one streamed completion, for benchmarks that share the server's cores.

On a 2-core machine the client's CPU is taken from the server's compute threads: httpx's async
line iterator plus a JSON parse of every chunk costs the server-path bench's client far more CPU
a token than a socket read does. This reader does one `recv` per arrival, decodes HTTP/1.1
chunked framing, splits SSE events, and parses an event's JSON only until the first one with
text, for the usage chunk at the end and for an error event; every other event is timed, not
parsed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class StreamError(RuntimeError):
    """The server answered something other than a 200 event stream."""


@dataclass(slots=True)
class StreamTimes:
    """Arrival times (perf_counter) of the first event with text and of the last event with a
    choice; the usage chunk's completion_tokens; the client's own CPU seconds (this thread)
    between the first text and the end."""

    first_text: float
    last_choice: float
    completion_tokens: int
    client_cpu_s: float


def stream_completion(url: str, body: dict[str, Any], on_first_text: Callable[[], None],
                      timeout_s: float = 600.0) -> StreamTimes:
    """POST `body` (which must ask for `stream_options.include_usage`) to `url` + /v1/completions
    and time its events; `on_first_text` runs once, when the first text arrives."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head + payload)
        reader = _EventReader(sock)
        first = last = 0.0
        tokens = 0
        cpu_start = 0.0
        for event, arrived in reader.events():
            if event == b"[DONE]":
                break
            # A key in quotes cannot come from generated text: JSON escapes its quotes.
            if first and b'"completion_tokens"' not in event and b'"error"' not in event:
                last = arrived  # a text chunk after the first: timed, not parsed
                continue
            chunk = json.loads(event)
            if "error" in chunk:
                raise StreamError(f"the stream ended with an error: {chunk['error']}")
            if (usage := chunk.get("usage")) is not None:
                tokens = int(usage["completion_tokens"])
            choices = chunk.get("choices") or ()
            if choices and not first and any(c.get("text") for c in choices):
                first = last = arrived
                cpu_start = time.thread_time()
                on_first_text()
            elif choices and first:
                last = arrived
        if not first or not tokens:
            raise StreamError("the stream carried no text or no usage chunk")
        return StreamTimes(first, last, tokens, time.thread_time() - cpu_start)


class _EventReader:
    """SSE events (the bytes after `data: `) from a chunked HTTP/1.1 response, each with the
    perf_counter of the `recv` that completed it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._raw = b""  # received, not yet de-chunked
        self._body = b""  # de-chunked, not yet split into events

    def _recv(self) -> float:
        data = self._sock.recv(1 << 16)
        if not data:
            raise StreamError("the server closed the connection before [DONE]")
        self._raw += data
        return time.perf_counter()

    def _headers(self) -> None:
        while b"\r\n\r\n" not in self._raw:
            self._recv()
        head, _, self._raw = self._raw.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if status.split()[1:2] != [b"200"]:
            while self._try_recv():
                pass
            raise StreamError(f"{status.decode(errors='replace')}: "
                              f"{self._raw[:300].decode(errors='replace')}")
        if b"transfer-encoding: chunked" not in head.lower():
            raise StreamError("expected a chunked event stream; got headers "
                              f"{head.decode(errors='replace')!r}")

    def _try_recv(self) -> bool:
        try:
            data = self._sock.recv(1 << 16)
        except OSError:
            return False
        self._raw += data
        return bool(data)

    def _dechunk(self) -> None:
        """Move every complete chunk from `_raw` to `_body`."""
        while True:
            size_end = self._raw.find(b"\r\n")
            if size_end < 0:
                return
            size = int(self._raw[:size_end].split(b";", 1)[0], 16)
            end = size_end + 2 + size + 2
            if len(self._raw) < end:
                return
            self._body += self._raw[size_end + 2:end - 2]
            self._raw = self._raw[end:]

    def events(self) -> Iterator[tuple[bytes, float]]:
        self._headers()
        arrived = time.perf_counter()
        while True:
            self._dechunk()
            while (cut := self._body.find(b"\n\n")) >= 0:
                event, self._body = self._body[:cut], self._body[cut + 2:]
                if event.startswith(b"data: "):
                    yield event[6:], arrived
            arrived = self._recv()
