"""Chained, collision-resistant block hashes.

hash(block i) = sha256(hash(block i-1) | extra keys | token ids). The first block's parent is the
root, and its extra keys carry the model, the LoRA adapter and the tenant salt, so the whole chain
differs between tenants, models and adapters. Tokens are hashed as fixed-width signed 64-bit
integers, and every variable-length field is length-prefixed, so no two different inputs share an
encoding.

The first block's extra keys are three typed fields in a fixed order: the model id (a string),
the adapter (absent, or the 32-byte sha256 digest of its weights and config: what it is, never
its name or a counter) and the salt (a string or absent). A string is framed by its length, which
is below 2**31; an absent field by 0xffffffff; a digest by the tag 0xfffffffe and 32 bytes. So no
string can stand for a digest, nor a salt for an adapter: vLLM #44701 (an adapter name and a
cache_salt with the same string collide) cannot happen, and a request without an adapter hashes
exactly as before adapters existed.
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


ABSENT_TAG = b"\xff\xff\xff\xff"
"""Frames an absent field (None and "" differ)."""

ADAPTER_DIGEST_TAG = b"\xfe\xff\xff\xff"
"""Frames an adapter digest: a length no string may have, so only a digest reads as one."""

DIGEST_SIZE = 32
_MAX_STRING_BYTES = 1 << 31


def _frame_string(key: str | None, field: str) -> bytes:
    if key is None:
        return ABSENT_TAG
    raw = key.encode("utf-8")
    if len(raw) >= _MAX_STRING_BYTES:
        raise ValueError(f"the {field} is {len(raw)} bytes; the limit is {_MAX_STRING_BYTES - 1}")
    return len(raw).to_bytes(4, "little") + raw


def encode_extra_keys(model_id: str, adapter_digest: bytes | None, salt: str | None) -> bytes:
    """The first block's extra keys: model id, adapter digest (None: the base model) and salt,
    each in its own typed field (see the module doc)."""
    if adapter_digest is None:
        adapter = ABSENT_TAG
    elif isinstance(adapter_digest, bytes) and len(adapter_digest) == DIGEST_SIZE:
        adapter = ADAPTER_DIGEST_TAG + adapter_digest
    else:
        raise TypeError(f"an adapter is identified by its {DIGEST_SIZE}-byte sha256 digest, "
                        f"got {adapter_digest!r}")
    return _frame_string(model_id, "model id") + adapter + _frame_string(salt, "cache salt")


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
