"""benchmarks/sse_reader.py against canned HTTP/1.1 answers sent in awkward pieces."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from benchmarks.sse_reader import StreamError, stream_completion


def _event(data: object) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def _chunked(*parts: bytes) -> bytes:
    """Each part as one HTTP chunk, then the last (empty) chunk."""
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


GAP_S = 0.02  # between the pieces the server sends
Piece = bytes | threading.Event


@pytest.fixture
def serve_bytes() -> Iterator[list[Piece]]:
    """Answers the first connection with the pieces put in the list, each sent on its own; an
    Event among them holds the rest back until it is set, so a gap is a gap however loaded the
    machine is."""
    pieces: list[Piece] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each piece on its own
            conn.recv(1 << 16)
            for piece in pieces:
                if isinstance(piece, threading.Event):
                    piece.wait(timeout=5)
                else:
                    conn.sendall(piece)
                time.sleep(GAP_S)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    pieces.append(f"http://127.0.0.1:{listener.getsockname()[1]}".encode())
    yield pieces
    thread.join(timeout=5)
    listener.close()


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _run(pieces: list[Piece], answer: Sequence[Piece],
         first_seen: threading.Event | None = None) -> tuple[object, list[str]]:
    address = pieces.pop()
    assert isinstance(address, bytes)
    url = address.decode()
    pieces.extend(answer)
    calls: list[str] = []

    def on_first() -> None:
        calls.append("first")
        if first_seen is not None:
            first_seen.set()

    return stream_completion(url, {"prompt": "x"}, on_first), calls


def test_times_the_first_text_and_the_last_choice_and_reads_usage(
        serve_bytes: list[Piece]) -> None:
    a = _event({"choices": [{"text": "a"}], "usage": None})
    framed = HEAD + _chunked(
        _event({"choices": [{"text": ""}], "usage": None}),  # no text yet: not the first
        a[:7], a[7:],  # an event across two chunks
        _event({"choices": [{"text": "b"}], "usage": None}),
        _event({"choices": [], "usage": {"completion_tokens": 2}}) + _event(b"[DONE]"))
    b_starts = framed.index(b'"b"') - 30
    first_seen = threading.Event()
    pieces: list[Piece] = [
        framed[i:min(i + 13, b_starts)] for i in range(0, b_starts, 13)]
    pieces += [first_seen, framed[b_starts:]]  # "b" goes out GAP_S after the reader saw "a"
    times, calls = _run(serve_bytes, pieces, first_seen)
    assert calls == ["first"]
    assert times.completion_tokens == 2  # type: ignore[attr-defined]
    assert times.last_choice - times.first_text >= GAP_S  # type: ignore[attr-defined]
    assert times.client_cpu_s >= 0  # type: ignore[attr-defined]


def test_an_error_status_is_raised_with_the_servers_message(serve_bytes: list[Piece]) -> None:
    answer = b"HTTP/1.1 404 Not Found\r\ncontent-length: 22\r\n\r\n{\"error\": \"no model\"}"
    with pytest.raises(StreamError, match=r"404 Not Found.*no model"):
        _run(serve_bytes, [answer])


def test_an_error_event_is_raised(serve_bytes: list[Piece]) -> None:
    body = _event({"choices": [{"text": "a"}]}) + _event({"error": {"message": "bad block"}})
    with pytest.raises(StreamError, match="bad block"):
        _run(serve_bytes, [HEAD + _chunked(body)])


def test_a_stream_without_usage_is_an_error(serve_bytes: list[Piece]) -> None:
    body = _event({"choices": [{"text": "a"}]}) + _event(b"[DONE]")
    with pytest.raises(StreamError, match="no usage"):
        _run(serve_bytes, [HEAD + _chunked(body)])
