"""Chained, collision-resistant block hashes.

hash(block i) = sha256(hash(block i-1) | extra keys | token ids). The first block's parent is the
root, and its extra keys carry the model/adapter identity and the tenant salt, so the whole chain
differs between tenants and models. Tokens are hashed as fixed-width signed 64-bit integers, and
every variable-length field is length-prefixed, so no two different inputs share an encoding.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache

ROOT_HASH = b"\x00" * 32
"""Parent of every first block."""

TOKEN_WIDTH = 8
"""Bytes per encoded token id (signed 64-bit)."""


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Fixed-width little-endian encoding of token ids (the same bytes on every platform); also
    what a cached block keeps for the hit re-check."""
    return _packer(len(token_ids)).pack(*token_ids)


@lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def encode_extra_keys(*keys: str | None) -> bytes:
    """Length-prefixed encoding of the first block's extra keys (None and "" differ)."""
    out = bytearray()
    for key in keys:
        if key is None:
            out += b"\xff\xff\xff\xff"
        else:
            raw = key.encode("utf-8")
            out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def hash_block(parent_hash: bytes, token_bytes: bytes, extra: bytes = b"") -> bytes:
    """The 32-byte hash of one full block given its parent's hash."""
    framed_extra = len(extra).to_bytes(4, "little") + extra
    return hashlib.sha256(parent_hash + framed_extra + token_bytes).digest()


def chain_hashes(
    parent_hash: bytes, blocks_bytes: bytes, block_bytes: int, first_extra: bytes | None
) -> tuple[list[bytes], list[bytes]]:
    """Hashes (and token bytes) of consecutive full blocks encoded back to back in
    `blocks_bytes`, chained from `parent_hash`; `first_extra` (None: not the root block) is the
    first block's extra keys. Equal to calling `hash_block` block by block, in one tight loop."""
    sha256 = hashlib.sha256
    no_extra = (0).to_bytes(4, "little")
    hashes: list[bytes] = []
    chunks: list[bytes] = []
    for offset in range(0, len(blocks_bytes), block_bytes):
        chunk = blocks_bytes[offset : offset + block_bytes]
        if first_extra is not None:
            parent_hash = hash_block(parent_hash, chunk, first_extra)
            first_extra = None
        else:
            parent_hash = sha256(parent_hash + no_extra + chunk).digest()
        hashes.append(parent_hash)
        chunks.append(chunk)
    return hashes, chunks
