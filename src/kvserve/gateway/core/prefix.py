"""Prefix keys: chained block hashes of what a worker will cache, salted per tenant.

Two ways to key a request:

- approximate (prompt text or chat messages): blocks of `block_chars` characters of a canonical
  text, hash(block i) = sha256(hash(block i-1) | utf-8 of the block), from a root that folds in
  the block size and the tenant salt;
- exact (token ids): the very chain kvserve.kvcache computes, so the `precise` policy can match a
  worker's KV events byte for byte (`engine_block_hashes`).

Only full blocks are hashed (a worker caches only full blocks), and a request's hashes are a
chain: two requests share a head of hashes exactly when they share that head of content and the
tenant. Everything is sha256, never Python's `hash()`, so every process and every gateway replica
computes the same keys.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

DEFAULT_BLOCK_CHARS = 256
"""Characters per approximate block (about 64 tokens of English text)."""

DEFAULT_BLOCK_TOKENS = 16
"""Token ids per exact block: kvserve's default KV block size."""

CHARS_PER_TOKEN = 4
"""Rough characters per token, for the token estimate of a text key."""

ROOT_HASH = b"\x00" * 32
"""Parent of every first block in the exact (engine) chain, as in kvserve.kvcache."""

CHAT_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
"""Message fields that chat templates render; the others (ids, metadata) never reach the cache."""

_TEXT_DOMAIN = b"kvserve.gateway.text.v1"
_NONE_KEY = b"\xff\xff\xff\xff"
_DIGEST_TAG = b"\xfe\xff\xff\xff"  # kvcache.hashing.ADAPTER_DIGEST_TAG: a length no string has
_NO_EXTRA = (0).to_bytes(4, "little")
_TEXT_ADAPTER_TAG = b"\xfd\xff\xff\xff"  # a length no string has: the adapter's own field


def _frame(key: str | None) -> bytes:
    """Length-prefixed utf-8 (None and "" differ), as kvcache's encode_extra_keys frames a key."""
    if key is None:
        return _NONE_KEY
    raw = key.encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(4, "little") + raw


def canonical_chat(
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None = None,
) -> str:
    """Canonical text of a chat request: one JSON line for the tools (when given), then one per
    message with the fields chat templates render, keys sorted. A conversation's canonical text
    starts with that of its earlier turns, so a growing chat keeps its prefix key.
    Raises ValueError when a message is not JSON-serialisable."""
    lines: list[str] = []
    try:
        if tools is not None:
            lines.append(_dumps({"tools": list(tools)}))
        for message in messages:
            lines.append(_dumps({k: message[k] for k in CHAT_FIELDS if k in message}))
    except TypeError as exc:
        raise ValueError(f"chat messages must be JSON-serialisable: {exc}") from exc
    return "".join(line + "\n" for line in lines)


def _dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def text_block_hashes(
    text: str, tenant: str | None = None, block_chars: int = DEFAULT_BLOCK_CHARS,
    adapter: str | None = None,
) -> tuple[bytes, ...]:
    """Chained hashes of the full `block_chars`-character blocks of `text`, salted by `tenant`
    (the cache salt the gateway forwards; None: unsalted) and keyed by the LoRA `adapter` the
    request runs under (None: the base model, whose hashes are those from before adapters).
    Different tenants, and different adapters, never share one."""
    # Invariant: hash i depends on text[: (i + 1) * block_chars], the block size, the tenant
    # and the adapter.
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    sha256 = hashlib.sha256
    root = _TEXT_DOMAIN + block_chars.to_bytes(8, "little") + _frame(tenant)
    if adapter is not None:
        root += _TEXT_ADAPTER_TAG + _frame(adapter)
    parent = sha256(root).digest()
    hashes: list[bytes] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        # The parent is fixed-width, so parent | block bytes has one reading.
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        parent = sha256(parent + block).digest()
        hashes.append(parent)
    return tuple(hashes)


def engine_extra_keys(model_id: str, adapter_digest: bytes | None, salt: str | None) -> bytes:
    """The first block's extra keys exactly as kvserve.kvcache encodes them
    (`encode_extra_keys(model_id, adapter_digest, salt)`): typed fields, the adapter by the
    32-byte sha256 digest of its weights and config (None: the base model)."""
    if adapter_digest is None:
        adapter = _NONE_KEY
    elif len(adapter_digest) == 32:
        adapter = _DIGEST_TAG + adapter_digest
    else:
        raise ValueError(f"an adapter digest is 32 bytes, got {len(adapter_digest)}")
    return _frame(model_id) + adapter + _frame(salt)


def engine_block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_TOKENS,
    salt: str | None = None,
    model_id: str = "",
    adapter_digest: bytes | None = None,
) -> tuple[bytes, ...]:
    """The block hashes a kvserve worker computes for `token_ids`, byte for byte: hash(block i) =
    sha256(parent | framed extra | int64-le token ids), parent of block 0 = 32 zero bytes, block
    0's extra = (model_id, adapter_digest, salt), later blocks' extra empty. Full blocks only.
    `block_size`, `salt` and `model_id` must be the worker's own, or nothing will match."""
    # Invariant: equal to kvserve.kvcache.hashing.chain_hashes from ROOT_HASH (pinned by a test).
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    packer = struct.Struct(f"<{block_size}q")
    sha256 = hashlib.sha256
    extra = engine_extra_keys(model_id, adapter_digest, salt)
    framed = len(extra).to_bytes(4, "little") + extra
    parent = ROOT_HASH
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        try:
            token_bytes = packer.pack(*token_ids[start : start + block_size])
        except struct.error as exc:
            raise ValueError(f"token ids must be signed 64-bit integers: {exc}") from exc
        parent = sha256(parent + framed + token_bytes).digest()
        framed = _NO_EXTRA
        hashes.append(parent)
    return tuple(hashes)


def engine_block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes | None) -> bytes:
    """One link of `engine_block_hashes`' chain: the block after `parent` holding `token_ids`,
    with `extra` = `engine_extra_keys(...)` for a first block and None for the others."""
    framed = _NO_EXTRA if extra is None else len(extra).to_bytes(4, "little") + extra
    try:
        token_bytes = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be signed 64-bit integers: {exc}") from exc
    return hashlib.sha256(parent + framed + token_bytes).digest()


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a policy routes on: a request's chained block hashes (a shared head of them is a
    shared cached prefix), its tenant, a token estimate, and the tokens one block stands for.
    Tenants never share a hash."""

    prefix_hashes: tuple[bytes, ...]
    tenant: str | None = None
    num_tokens: int = 0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    adapter: str | None = None  # the LoRA adapter's name (None: the base model)

    @classmethod
    def from_text(
        cls, text: str, tenant: str | None = None, *, block_chars: int = DEFAULT_BLOCK_CHARS,
        adapter: str | None = None,
    ) -> Self:
        """Key a completion prompt by its text (approximate: blocks of characters), under
        `adapter` (its name; None: the base model)."""
        return cls(
            text_block_hashes(text, tenant, block_chars, adapter), tenant,
            -(-len(text) // CHARS_PER_TOKEN), max(1, block_chars // CHARS_PER_TOKEN), adapter,
        )

    @classmethod
    def from_messages(
        cls,
        messages: Sequence[Mapping[str, object]],
        tenant: str | None = None,
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        adapter: str | None = None,
    ) -> Self:
        """Key a chat request by its canonical text (`canonical_chat`), tools included."""
        return cls.from_text(canonical_chat(messages, tools), tenant, block_chars=block_chars,
                             adapter=adapter)

    @classmethod
    def from_token_ids(
        cls,
        token_ids: Sequence[int],
        tenant: str | None = None,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        model_id: str = "",
        adapter_digest: bytes | None = None,
        adapter: str | None = None,
    ) -> Self:
        """Key a tokenized prompt exactly as a kvserve worker hashes it (`engine_block_hashes`,
        the tenant as the cache salt, the adapter by `adapter_digest`): what the `precise`
        policy needs. `adapter` is the adapter's name, for the scorers."""
        hashes = engine_block_hashes(token_ids, block_tokens, tenant, model_id, adapter_digest)
        return cls(hashes, tenant, len(token_ids), block_tokens, adapter)
