"""The KV transfer wire format: a stream of binary frames, one per KV block, then an end frame.

Every frame is a fixed 56-byte little-endian header and a payload:

    magic "KVSF" | version u8 | kind u8 | reserved u16 | block_idx u32 | num_tokens u32 |
    block_hash 32 bytes | payload_len u32 | crc32 u32

`kind` is BLOCK (the payload is the block's K and V for every layer, see
kvserve.model.kv_export), END (`block_idx` is the number of blocks sent; no payload: a stream
cut at a frame boundary is still detected) or ERROR (the payload is a UTF-8 message). `crc32`
covers the header before it and the payload, so a flipped bit anywhere is caught.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVSF"
VERSION = 1
_HEADER = struct.Struct("<4sBBHII32sII")
HEADER_BYTES = _HEADER.size  # 56
_CRC_OFFSET = HEADER_BYTES - 4


class FrameKind(enum.IntEnum):
    BLOCK = 1
    END = 2
    ERROR = 3


class FrameError(ValueError):
    """The stream is not a valid KV frame stream; the message says what is wrong."""


class ChecksumMismatch(FrameError):
    """A frame's CRC32 does not match its bytes: it was corrupted on the way."""


class TruncatedStream(FrameError):
    """The stream ended inside a frame or before its end frame."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame (its checksum verified)."""

    kind: FrameKind
    block_idx: int
    num_tokens: int
    block_hash: bytes
    payload: bytes


def encode_frame(kind: FrameKind, block_idx: int, num_tokens: int = 0,
                 block_hash: bytes = b"\x00" * 32, payload: bytes = b"") -> bytes:
    """One frame's bytes (header + payload)."""
    if len(block_hash) != 32:
        raise ValueError(f"a block hash is 32 bytes, got {len(block_hash)}")
    head = _HEADER.pack(MAGIC, VERSION, kind, 0, block_idx, num_tokens, block_hash,
                        len(payload), 0)[:_CRC_OFFSET]
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + crc.to_bytes(4, "little") + payload


def encode_block(block_idx: int, num_tokens: int, block_hash: bytes, payload: bytes) -> bytes:
    return encode_frame(FrameKind.BLOCK, block_idx, num_tokens, block_hash, payload)


def encode_end(num_blocks: int) -> bytes:
    return encode_frame(FrameKind.END, num_blocks)


def encode_error(message: str) -> bytes:
    return encode_frame(FrameKind.ERROR, 0, payload=message.encode("utf-8"))


class FrameDecoder:
    """Incremental decoder: `feed` bytes as they arrive, get whole verified frames back; `finish`
    once the stream ended. Frames after END are an error; payloads over `max_payload` bytes are
    refused before they are buffered."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buffer = bytearray()
        self.ended = False
        self.num_bytes = 0

    def feed(self, data: bytes) -> list[Frame]:
        """The frames completed by `data`. Raises FrameError (ChecksumMismatch for a corrupted
        frame) on the first bad frame."""
        self.num_bytes += len(data)
        self._buffer += data
        out = []
        while len(self._buffer) >= HEADER_BYTES:
            magic, version, kind, _, idx, num_tokens, block_hash, length, crc = \
                _HEADER.unpack_from(self._buffer)
            if magic != MAGIC:
                raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the "
                                 "peer does not speak the kvserve KV transfer protocol")
            if version != VERSION:
                raise FrameError(f"KV frame version {version}, this worker speaks {VERSION}: "
                                 "run the same kvserve version on prefill and decode workers")
            if length > self.max_payload:
                raise FrameError(f"a KV frame announces {length} payload bytes, more than the "
                                 f"{self.max_payload} a block of this model holds")
            if len(self._buffer) < HEADER_BYTES + length:
                break
            payload = bytes(self._buffer[HEADER_BYTES:HEADER_BYTES + length])
            want = zlib.crc32(payload, zlib.crc32(self._buffer[:_CRC_OFFSET]))
            if want != crc:
                raise ChecksumMismatch(f"checksum mismatch in the KV frame of block {idx}: "
                                       f"crc32 {want:#010x}, frame says {crc:#010x}")
            del self._buffer[:HEADER_BYTES + length]
            if self.ended:
                raise FrameError("a KV frame arrived after the end frame")
            try:
                frame_kind = FrameKind(kind)
            except ValueError:
                raise FrameError(f"unknown KV frame kind {kind}") from None
            self.ended = frame_kind is not FrameKind.BLOCK
            out.append(Frame(frame_kind, idx, num_tokens, bytes(block_hash), payload))
        return out

    def finish(self) -> None:
        """The stream ended: raises TruncatedStream unless it ended right after an end frame."""
        if self._buffer:
            raise TruncatedStream(f"the KV stream was cut inside a frame ({len(self._buffer)} "
                                  "bytes of it arrived)")
        if not self.ended:
            raise TruncatedStream("the KV stream ended before its end frame")
