"""The KV transfer frame codec: round trip, incremental arrival, and every way a stream is bad."""

from __future__ import annotations

import pytest

from kvserve.server.kv.frames import (
    HEADER_BYTES,
    ChecksumMismatch,
    FrameDecoder,
    FrameError,
    FrameKind,
    TruncatedStream,
    encode_block,
    encode_end,
    encode_error,
)

HASHES = [bytes([i]) * 32 for i in range(3)]
PAYLOADS = [bytes(range(256)) * 4, b"\x00" * 1024, bytes(reversed(range(256))) * 4]


def stream() -> bytes:
    return b"".join(encode_block(5 + i, 16, h, p)
                    for i, (h, p) in enumerate(zip(HASHES, PAYLOADS, strict=True))) + encode_end(3)


def test_round_trip_whole_and_byte_by_byte() -> None:
    data = stream()
    for chunk_size in (len(data), 1, 7, HEADER_BYTES):
        decoder = FrameDecoder(max_payload=1024)
        frames = []
        for i in range(0, len(data), chunk_size):
            frames += decoder.feed(data[i:i + chunk_size])
        decoder.finish()
        assert [(f.kind, f.block_idx, f.num_tokens, f.block_hash, f.payload)
                for f in frames] == [
            (FrameKind.BLOCK, 5, 16, HASHES[0], PAYLOADS[0]),
            (FrameKind.BLOCK, 6, 16, HASHES[1], PAYLOADS[1]),
            (FrameKind.BLOCK, 7, 16, HASHES[2], PAYLOADS[2]),
            (FrameKind.END, 3, 0, b"\x00" * 32, b""),
        ]
        assert decoder.num_bytes == len(data)


def test_error_frame_carries_its_message() -> None:
    (frame,) = FrameDecoder(1024).feed(encode_error("prefill failed: boom"))
    assert frame.kind is FrameKind.ERROR and frame.payload == b"prefill failed: boom"


@pytest.mark.parametrize("cut", [1, HEADER_BYTES - 1, HEADER_BYTES + 10])
def test_a_stream_cut_inside_a_frame_is_truncated(cut: int) -> None:
    decoder = FrameDecoder(1024)
    assert decoder.feed(stream()[:cut]) == []
    with pytest.raises(TruncatedStream, match="inside a frame"):
        decoder.finish()


def test_a_stream_cut_at_a_frame_boundary_misses_its_end_frame() -> None:
    one = encode_block(0, 16, HASHES[0], PAYLOADS[0])
    decoder = FrameDecoder(1024)
    assert len(decoder.feed(one)) == 1
    with pytest.raises(TruncatedStream, match="before its end frame"):
        decoder.finish()


def test_bad_magic_and_version_are_refused() -> None:
    data = bytearray(stream())
    data[0:4] = b"HTTP"
    with pytest.raises(FrameError, match="bad frame magic"):
        FrameDecoder(1024).feed(bytes(data))
    data = bytearray(stream())
    data[4] = 9
    with pytest.raises(FrameError, match="version 9"):
        FrameDecoder(1024).feed(bytes(data))


@pytest.mark.parametrize("offset", [HEADER_BYTES + 100, 20, 12])  # payload, hash, block index
def test_one_flipped_byte_is_a_checksum_mismatch(offset: int) -> None:
    data = bytearray(stream())
    data[offset] ^= 0x40
    with pytest.raises(ChecksumMismatch, match="checksum mismatch"):
        FrameDecoder(1024).feed(bytes(data))


def test_an_oversized_payload_is_refused_before_it_is_buffered() -> None:
    with pytest.raises(FrameError, match="more than the 512"):
        FrameDecoder(max_payload=512).feed(stream()[:HEADER_BYTES])


def test_frames_after_the_end_frame_are_refused() -> None:
    with pytest.raises(FrameError, match="after the end frame"):
        FrameDecoder(1024).feed(encode_end(0) + encode_end(0))
