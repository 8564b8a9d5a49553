"""vLLM's KV-event messages, decoded and encoded without sockets.

A message is three ZMQ frames: topic (utf-8), sequence number (8 bytes, big-endian, one per
batch, from 0 at the publisher's start) and a msgpack batch `[ts, events, data_parallel_rank]`.
Events come in either of the encodings vLLM versions have sent: tagged arrays (the tag, then the
fields in declaration order, trailing defaults left out) or maps with a `"type"` key. Fields this
decoder does not know are ignored; a malformed message raises `WireError` saying what is wrong.
Block hashes are uint64 integers (vLLM's default) or bytes (sha256 hashes, kvserve's).
The replay endpoint answers with the same three frames per batch, then an end marker whose
sequence frame is -1 (`END_OF_REPLAY_SEQ`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

ExternalHash = int | bytes
"""A block hash as the publisher computed it: only ever compared, never recomputed."""

END_OF_REPLAY_SEQ = (1 << 64) - 1  # the unsigned reading of the 8-byte -1 vLLM sends
MEDIUM_GPU = "GPU"


class WireError(ValueError):
    """A message that is not a vLLM KV-event message."""


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """`BlockStored`: blocks that became hit-able, extending the chain after `parent_block_hash`
    (None: from the root). `token_ids` are the blocks' tokens, `block_size` per block;
    `extra_keys`, when sent, has one entry per block (LoRA name, multimodal pairs, the request's
    cache salt, ... untagged). `medium`: where the KV lives (GPU when not said)."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """`BlockRemoved`: blocks no longer hit-able on `medium` (None: on every medium)."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    """`AllBlocksCleared`: the publisher's cache forgot everything."""


WireEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One batch: every event of one engine step, in order."""

    topic: str
    seq: int
    ts: float
    events: tuple[WireEvent, ...]
    data_parallel_rank: int | None = None


# Field order of the tagged-array encoding (vLLM's struct declaration order).
ADAPTER_KEY_PREFIX = "lora-sha256:"
"""How a kvserve worker names a LoRA adapter in a first block's `extra_keys`: this prefix and
the hex sha256 of the adapter's weights and config (its cache identity), where vLLM puts the
adapter's name. A string no salt or name of vLLM's starts with by accident."""


def adapter_extra_key(digest: bytes) -> str:
    """The `extra_keys` entry that identifies a LoRA adapter by its 32-byte digest."""
    return ADAPTER_KEY_PREFIX + digest.hex()


def adapter_name_digest(lora_name: str) -> bytes:
    """A vLLM worker's adapter identity: sha256 of its name (vLLM keys an adapter's blocks by
    name, so the name is all a reader of its events can key by)."""
    return hashlib.sha256(b"vllm-lora-name:" + lora_name.encode()).digest()


def parse_first_block_keys(extra: tuple[object, ...] | None,
                           lora_name: str | None) -> tuple[bytes | None, str | None]:
    """(adapter digest, cache salt) from a first block's untagged extra keys: kvserve's
    digest entry, else (a vLLM worker) the adapter's name standing first when the event names
    one, identified by sha256 of the name (vLLM's own identity); the salt is the first string
    after it. (None, None) for the base model and no salt."""
    values = list(extra or ())
    digest: bytes | None = None
    first = values[0] if values else None
    if isinstance(first, str) and first.startswith(ADAPTER_KEY_PREFIX):
        digest = bytes.fromhex(first[len(ADAPTER_KEY_PREFIX):])
        values.pop(0)
    elif lora_name is not None:
        digest = adapter_name_digest(lora_name)
        if values and values[0] == lora_name:
            values.pop(0)
    salt = next((v for v in values if isinstance(v, str)), None)
    return digest, salt


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_seq(frame: bytes) -> int:
    """The sequence number of a message's second frame."""
    if len(frame) != 8:
        raise WireError(f"the sequence frame has {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> EventMessage:
    """Decode (topic, seq, payload) frames; WireError if they are not a KV-event message."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames (topic, seq, payload), got "
                        f"{len(frames)}")
    topic, seq_frame, payload = frames
    try:
        topic_text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"the topic frame is not utf-8: {exc}") from exc
    ts, events, rank = decode_batch(payload)
    return EventMessage(topic_text, decode_seq(seq_frame), ts, events, rank)


def decode_batch(payload: bytes) -> tuple[float, tuple[WireEvent, ...], int | None]:
    """(ts, events, data_parallel_rank) of a msgpack batch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"the payload is not msgpack: {exc}") from exc
    if not isinstance(batch, list | tuple) or not 2 <= len(batch) <= 3:
        raise WireError("the payload must be an array [ts, events, data_parallel_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise WireError(f"the batch timestamp must be a number, got {ts!r}")
    if not isinstance(raw_events, list | tuple):
        raise WireError("the batch's events must be an array")
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        raise WireError(f"data_parallel_rank must be an integer >= 0 or nil, got {rank!r}")
    return float(ts), tuple(decode_event(e) for e in raw_events), rank


def decode_event(raw: object) -> WireEvent:
    """One event from either encoding (tagged array, or map with "type")."""
    if isinstance(raw, Mapping):
        tag, fields = raw.get("type"), dict(raw)
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(
            tag if isinstance(tag, str) else "", ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise WireError(f"an event must be a tagged array or a map, got {raw!r:.80}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return RemovedBlocks(_hashes(fields.get("block_hashes")), _medium(fields, None))
    if tag == "AllBlocksCleared":
        return AllCleared()
    raise WireError(f"unknown KV event type {tag!r}")


def _stored(fields: Mapping[str, Any]) -> StoredBlocks:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent)
    token_ids, block_size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise WireError(f"BlockStored.block_size must be an integer >= 1, got {block_size!r}")
    if not isinstance(token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise WireError("BlockStored.token_ids must be an array of integers")
    if len(token_ids) != len(hashes) * block_size:
        raise WireError(f"BlockStored has {len(hashes)} blocks of {block_size} tokens but "
                        f"{len(token_ids)} token ids")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise WireError(f"BlockStored.lora_name must be a string or nil, got {lora_name!r}")
    extra = fields.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list | tuple) or len(extra) != len(hashes) or not all(
                e is None or isinstance(e, list | tuple) for e in extra):
            raise WireError("BlockStored.extra_keys must hold one array (or nil) per block")
        extra = tuple(None if e is None else tuple(e) for e in extra)
    return StoredBlocks(hashes, parent, tuple(token_ids), block_size,
                        _medium(fields, MEDIUM_GPU) or MEDIUM_GPU, lora_name, extra)


def _medium(fields: Mapping[str, Any], default: str | None) -> str | None:
    medium = fields.get("medium")
    if medium is None:
        return default
    if not isinstance(medium, str):
        raise WireError(f"medium must be a string or nil, got {medium!r}")
    return medium.upper()


def _hash(value: object) -> ExternalHash:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return value
    raise WireError(f"a block hash must be a uint64 or bytes, got {value!r:.80}")


def _hashes(value: object) -> tuple[ExternalHash, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise WireError("block_hashes must be a non-empty array")
    return tuple(_hash(v) for v in value)


def encode_event(event: WireEvent) -> dict[str, Any]:
    """The map encoding (vLLM 0.32's), fields with no value left out."""
    if isinstance(event, StoredBlocks):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
            "block_size": event.block_size, "lora_id": None, "medium": event.medium,
            "lora_name": event.lora_name}
        if event.extra_keys is not None:
            out["extra_keys"] = [None if e is None else list(e) for e in event.extra_keys]
        return out
    if isinstance(event, RemovedBlocks):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[WireEvent], rank: int | None = 0) -> bytes:
    """A msgpack batch `[ts, events, data_parallel_rank]`."""
    payload: bytes = msgpack.packb([ts, [encode_event(e) for e in events], rank],
                                   use_bin_type=True)
    return payload


def encode_message(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one published batch."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]
