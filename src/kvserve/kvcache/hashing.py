"""Chained, collision-resistant block hashes.

hash(block i) = sha256(hash(block i-1) | extra keys | token ids). The first block's parent is the
root, and its extra keys carry the model/adapter identity and the tenant salt, so the whole chain
differs between tenants and models. Tokens are hashed as fixed-width signed 64-bit integers, and
every variable-length field is length-prefixed, so no two different inputs share an encoding.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"\x00" * 32
"""Parent of every first block."""

TOKEN_WIDTH = 8
"""Bytes per encoded token id (signed 64-bit)."""


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Fixed-width encoding of token ids; also what a cached block keeps for the hit re-check."""
    return array("q", token_ids).tobytes()


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
