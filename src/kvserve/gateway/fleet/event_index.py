"""From one worker's KV events (vLLM's wire, decoded) to the `precise` policy's keys.

The policy keys blocks by kvserve's own chain (`prefix.engine_block_hash` over the event's token
ids, the worker's model id and the tenant's cache salt in the first block), never by the
publisher's hash, so it matches what the gateway computes for a prompt whatever hash function
the engine uses (vLLM's default uint64 hashes, kvserve's sha256). The publisher's hash is kept
only to find a block again: a child's parent, and a `BlockRemoved`.

The salt of a chain's first block comes from the event's `extra_keys` (vLLM sends the request's
`cache_salt` there, after the LoRA name when there is one); the gateway injects the tenant's salt
as `cache_salt`, so the keys agree. A LoRA adapter is keyed by its digest in its own typed field
(`kvevents.wire.parse_first_block_keys`): kvserve workers send the digest of the adapter's weights
in `extra_keys`; a vLLM worker's adapter is keyed by its name. So a LoRA block never keys as a
base-model block nor as another adapter's, and the keys of kvserve's blocks equal the workers'
own hashes. A kvserve event names the adapter beside its digest: the feed tells the gateway's
`AdapterCatalog`, which keys that adapter's requests by the same digest. A block is held per
medium (GPU, CPU, disk...): moved to CPU it still counts as cached, and goes only when no
medium holds it. A block whose parent this feed never saw (events lost) cannot be keyed and
is skipped (`num_orphans`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.gateway.core.adapters import AdapterCatalog
from kvserve.gateway.core.prefix import ROOT_HASH, engine_block_hash, engine_extra_keys
from kvserve.kvevents.wire import (
    MEDIUM_GPU,
    AllCleared,
    ExternalHash,
    RemovedBlocks,
    StoredBlocks,
    WireEvent,
    parse_first_block_keys,
)

log = logging.getLogger(__name__)

TIER_ORDER = (MEDIUM_GPU, "CPU", "DISK", "STORAGE")
"""Fastest first: the tier a block held on several media is reported at."""


class EventSink(Protocol):
    """What the feed tells (the precise policy's exact index, `policies.indexes.ExactIndex`):
    blocks stored, removed, or all cleared; and whether a worker's stream is in sync."""

    def apply_events(self, worker_id: str, stored: Iterable[bytes] = (),
                     removed: Iterable[bytes] = (), cleared: bool = False) -> None: ...

    def set_synced(self, worker_id: str, synced: bool) -> None: ...

    def is_synced(self, worker_id: str) -> bool: ...


@dataclass(slots=True)
class _Entry:
    key: bytes
    media: set[str] = field(default_factory=set)


def first_block_salt(extra: tuple[object, ...] | None, lora_name: str | None) -> str | None:
    """The cache salt among a first block's untagged extra keys: the first string after the
    LoRA name (when the event names one); None when the request was not salted."""
    if not extra:
        return None
    return parse_first_block_keys(extra, lora_name)[1]


class WorkerIndexFeed:
    """One worker's events into `sink` (the precise policy), keyed as the module doc says.
    Each data-parallel rank is its own stream of publisher hashes; their blocks are the
    worker's. Not thread-safe: one event loop applies everything."""

    def __init__(self, sink: EventSink, worker_id: str, model_id: str,
                 block_size: int | None = None, adapters: AdapterCatalog | None = None) -> None:
        self.sink, self.worker_id, self.model_id = sink, worker_id, model_id
        self.adapters = adapters
        self.block_size = block_size  # the gateway's: prompts are keyed in blocks of it
        self._warned_block_size = False
        self._entries: dict[tuple[int, ExternalHash], _Entry] = {}
        self._refs: dict[bytes, int] = {}  # key -> entries (ranks) holding it
        self.num_orphans = 0
        self.num_events = 0

    def __len__(self) -> int:
        """Distinct blocks (keys) the worker holds on any medium."""
        return len(self._refs)

    def key_of(self, external: ExternalHash, rank: int = 0) -> bytes | None:
        """kvserve's key for the publisher's block hash, if held."""
        entry = self._entries.get((rank, external))
        return entry.key if entry is not None else None

    def blocks_by_tier(self) -> dict[str, int]:
        """How many held blocks sit at each tier (a block's fastest medium)."""
        best: dict[bytes, int] = {}
        for entry in self._entries.values():
            rank = min((TIER_ORDER.index(m) if m in TIER_ORDER else len(TIER_ORDER))
                       for m in entry.media)
            best[entry.key] = min(rank, best.get(entry.key, rank))
        counts = Counter(TIER_ORDER[r] if r < len(TIER_ORDER) else "OTHER"
                         for r in best.values())
        return dict(counts)

    def apply(self, events: Iterable[WireEvent], rank: int = 0) -> None:
        """Apply one batch's events in order."""
        for event in events:
            self.num_events += 1
            if isinstance(event, StoredBlocks):
                self._stored(event, rank)
            elif isinstance(event, RemovedBlocks):
                self._removed(event.block_hashes, event.medium, rank)
            elif isinstance(event, AllCleared):
                self.clear_rank(rank)

    def clear_rank(self, rank: int = 0) -> None:
        """Forget what `rank` holds (its cache was reset, or its publisher restarted)."""
        gone = [h for (r, h) in self._entries if r == rank]
        if len(gone) == len(self._entries):
            self._entries.clear()
            self._refs.clear()
            self.sink.apply_events(self.worker_id, cleared=True)
            return
        self._removed(gone, None, rank)

    def _stored(self, event: StoredBlocks, rank: int) -> None:
        # Invariant: a key is derived only from a parent key this feed derived itself.
        if event.parent_block_hash is None:
            parent, parent_known = ROOT_HASH, True
        else:
            entry = self._entries.get((rank, event.parent_block_hash))
            parent, parent_known = (entry.key, True) if entry is not None else (ROOT_HASH, False)
        if not parent_known:
            self.num_orphans += len(event.block_hashes)
            return
        size = event.block_size
        if self.block_size is not None and size != self.block_size and not self._warned_block_size:
            self._warned_block_size = True
            log.warning("kvserve gateway: %s caches blocks of %d tokens but the gateway keys "
                        "prompts in blocks of %d: no prompt will match its index; start the "
                        "gateway with --block-size %d", self.worker_id, size, self.block_size,
                        size)
        keys: list[bytes] = []
        for idx, external in enumerate(event.block_hashes):
            extra = None
            if parent == ROOT_HASH:
                block_extra = event.extra_keys[idx] if event.extra_keys is not None else None
                digest, salt = parse_first_block_keys(block_extra, event.lora_name)
                if (digest is not None and event.lora_name is not None
                        and self.adapters is not None):
                    self.adapters.learn_digest(event.lora_name, digest)
                extra = engine_extra_keys(self.model_id, digest, salt)
            key = engine_block_hash(parent, event.token_ids[idx * size:(idx + 1) * size], extra)
            entry = self._entries.get((rank, external))
            if entry is None:
                entry = self._entries[(rank, external)] = _Entry(key)
                self._refs[key] = self._refs.get(key, 0) + 1
            entry.media.add(event.medium)
            keys.append(key)
            parent = key
        # Always told, even when held already: the policy may have forgotten the worker.
        self.sink.apply_events(self.worker_id, stored=keys)

    def _removed(self, externals: Sequence[ExternalHash], medium: str | None,
                 rank: int) -> None:
        removed: list[bytes] = []
        for external in externals:
            entry = self._entries.get((rank, external))
            if entry is None:
                continue
            if medium is not None:
                entry.media.discard(medium)
                if entry.media:
                    continue  # still on another tier: still a hit
            del self._entries[(rank, external)]
            refs = self._refs[entry.key] - 1
            if refs:
                self._refs[entry.key] = refs
            else:
                del self._refs[entry.key]
                removed.append(entry.key)
        if removed:
            self.sink.apply_events(self.worker_id, removed=removed)
