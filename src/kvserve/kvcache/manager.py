"""The request-level KV cache manager: the only API the engine uses.

Life of a request: `add_request` → `lookup` (read-only) → `allocate_slots` (all-or-nothing, may
consume the lookup's hit) → the model writes KV → `commit` (full blocks become shareable) → more
`append_token_ids` / `allocate_slots` / `commit` while decoding → `free` (one path for every
ending, idempotent). `verify` before a step proves no block was reassigned under the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from kvserve.kvcache.audit import AuditReport, run_audit
from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.errors import CacheCorruption, UnknownRequest
from kvserve.kvcache.events import KVEvent
from kvserve.kvcache.hashing import (
    ROOT_HASH,
    TOKEN_WIDTH,
    chain_hashes,
    encode_extra_keys,
    encode_tokens,
)
from kvserve.kvcache.ledger import Ledger, LedgerEntry, RequestRecord
from kvserve.kvcache.stats import KVCacheCounters, KVCacheStats
from kvserve.kvcache.types import FreeReason, PrefixHit, SlotAllocation


class KVCacheManager:
    """Paged KV cache with automatic prefix caching for many requests and tenants.

    Pure bookkeeping (no tensors): it decides which physical blocks hold which tokens. Single
    threaded: the engine's step loop owns it. Contracts: DESIGN.md, "Invariants of the KV cache".
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        enable_events: bool = False,
        model_id: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = KVCacheCounters()
        self.pool = BlockPool(num_blocks, block_size, self.counters, enable_events=enable_events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.ledger = Ledger()
        # Full prompt blocks allocated to a live request but not yet committed: hash -> request.
        self.pending: dict[bytes, str] = {}
        self._clock = clock

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> None:
        """Start tracking a request with its prompt. `cache_salt` isolates tenants: requests
        with different salts never share a block. It must come from a trusted layer."""
        now = self._clock()
        self.ledger.add(
            RequestRecord(
                request_id=request_id,
                token_ids=list(token_ids),
                salt=cache_salt,
                root_extra=encode_extra_keys(self.model_id, adapter_id, cache_salt),
                created_at=now,
                last_active=now,
            )
        )

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Extend a request's sequence with generated tokens (their KV is written later)."""
        record = self._record(request_id)
        record.token_ids.extend(token_ids)
        record.last_active = self._clock()

    def lookup(self, request_id: str) -> PrefixHit:
        """The longest cached head of the request's tokens. Read-only: changes no refcount,
        queue position or hit statistic (a refused hash collision is counted). Capped so that at
        least one token is left to compute."""
        record = self._record(request_id)
        if not self.enable_prefix_caching or record.block_table:
            return PrefixHit()
        max_blocks = (len(record.token_ids) - 1) // self.block_size
        self._ensure_hashes(record, max_blocks)
        hit: list[KVBlock] = []
        for idx in range(max_blocks):
            block = self.pool.get_cached_block(
                record.block_hashes[idx], record.block_token_bytes[idx]
            )
            if block is None:
                break
            hit.append(block)
        num_pending = 0
        for idx in range(len(hit), max_blocks):
            if self.pending.get(record.block_hashes[idx]) in (None, request_id):
                break
            num_pending += 1
        return PrefixHit(
            block_ids=tuple(b.block_id for b in hit),
            epochs=tuple(b.epoch for b in hit),
            num_tokens=len(hit) * self.block_size,
            num_pending_tokens=num_pending * self.block_size,
        )

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` more tokens after those already computed.

        On the first allocation `prefix_hit` (from `lookup`) is taken: its blocks join the table
        and its tokens count as computed. Returns None when there is not enough free space, and
        then nothing has changed: no refcount, queue position, map entry or counter.
        """
        # Invariant: capacity is checked before any block is touched (all-or-nothing).
        record = self._record(request_id)
        hit_blocks: list[KVBlock] = []
        if prefix_hit is not None and prefix_hit.block_ids:
            if record.block_table:
                raise ValueError(f"request {request_id!r}: a prefix hit is only taken at admission")
            hit_blocks = [self.pool.blocks[i] for i in prefix_hit.block_ids]
            # A hit must still be the very content this request hashed, at the epoch seen.
            self._ensure_hashes(record, len(hit_blocks))
            expected = record.block_hashes[: len(hit_blocks)]
            if [b.epoch for b in hit_blocks] != list(prefix_hit.epochs) or any(
                b.block_hash != h for b, h in zip(hit_blocks, expected, strict=True)
            ):
                raise ValueError(f"request {request_id!r}: stale prefix hit; call lookup again")
        num_computed = record.num_computed_tokens + len(hit_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        if num_tokens > len(record.token_ids) or num_new_tokens < 0:
            raise ValueError(
                f"request {request_id!r}: cannot allocate {num_new_tokens} new tokens after "
                f"{num_computed} computed; it has only {len(record.token_ids)} tokens"
            )
        num_needed = -(-num_tokens // self.block_size) - len(record.block_table) - len(hit_blocks)
        num_needed = max(num_needed, 0)
        num_reclaimed_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed + num_reclaimed_hits > self.pool.num_free_blocks:
            return None

        is_admission = not record.block_table
        self.pool.touch(hit_blocks, request_id)
        new_blocks = self.pool.allocate(num_needed, request_id)
        assert new_blocks is not None, "free count checked above"
        for block in (*hit_blocks, *new_blocks):
            record.block_table.append(block)
            record.block_epochs.append(block.epoch)
        if hit_blocks:
            record.num_computed_tokens = num_computed
            record.num_cached_tokens = num_computed
        if is_admission and self.enable_prefix_caching:
            self.counters.prefix_queries_tokens += len(record.token_ids)
            self.counters.prefix_hits_tokens += record.num_cached_tokens
        if self.enable_prefix_caching:
            self._mark_pending(record)
        record.last_active = self._clock()
        return SlotAllocation(tuple(b.block_id for b in new_blocks), record.num_cached_tokens)

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """The model has written KV for the first `num_computed_tokens` tokens. Full blocks among
        them become shareable now, never earlier (a hash is published only over written KV)."""
        record = self._record(request_id)
        capacity = len(record.block_table) * self.block_size
        if not record.num_computed_tokens <= num_computed_tokens <= min(
            capacity, len(record.token_ids)
        ):
            raise ValueError(
                f"request {request_id!r}: commit of {num_computed_tokens} tokens is outside "
                f"[{record.num_computed_tokens}, {min(capacity, len(record.token_ids))}]"
            )
        first_new_full = record.num_computed_tokens // self.block_size
        num_full = num_computed_tokens // self.block_size
        record.num_computed_tokens = num_computed_tokens
        if record.pending_hashes:
            self._unmark_pending(record, record.block_hashes[first_new_full:num_full])
        record.last_active = self._clock()
        if not self.enable_prefix_caching or num_full <= first_new_full:
            return
        self._ensure_hashes(record, num_full)
        bs = self.block_size
        for idx in range(first_new_full, num_full):
            block = record.block_table[idx]
            block_hash = record.block_hashes[idx]
            if block.block_hash is not None:
                # A prefix-hit block, already cached under this very hash. Any other hash is a
                # key left behind by a reuse: counted here, named by the audit, never hit (the
                # lookup refuses a block whose epoch moved on since it was cached).
                if block.block_hash != block_hash:
                    self.counters.corruption_detections += 1
                continue
            parent = record.block_hashes[idx - 1] if idx else None
            token_ids = record.token_ids[idx * bs : (idx + 1) * bs]
            tb = record.block_token_bytes[idx]
            if not self.pool.cache_block(block, block_hash, parent, token_ids, tb, record.salt):
                self._adopt_cached_twin(record, idx)

    def free(self, request_id: str, reason: FreeReason = FreeReason.FINISHED) -> int:
        """Release everything the request holds; the one path for every ending. Idempotent:
        freeing an unknown or already-freed request does nothing and returns 0."""
        record = self.ledger.pop(request_id)
        if record is None:
            self.counters.redundant_frees += 1
            return 0
        self._unmark_pending(record, list(record.pending_hashes))
        # Deepest block first, so a surviving prefix is always a contiguous head.
        self.pool.free(reversed(record.block_table))
        num_blocks = len(record.block_table)
        by_reason = self.counters.frees_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        return num_blocks

    # -- integrity ------------------------------------------------------------------------

    def verify(self, request_id: str, checksums: Mapping[int, int] | None = None) -> None:
        """Prove the request's blocks are still its own before a step reads them.

        Raises `CacheCorruption` (and counts it) if any block was reassigned (epoch changed),
        released (refcount 0) or, when `checksums` are given, holds different content than the
        checksum recorded when it was written.
        """
        record = self._record(request_id)
        for block, epoch in zip(record.block_table, record.block_epochs, strict=True):
            detail = None
            if block.epoch != epoch:
                detail = "block was reassigned to other content while this request held it"
            elif block.ref_cnt <= 0:
                detail = "block was released while this request still holds it"
            elif checksums is not None and block.block_id in checksums and (
                block.checksum is not None and block.checksum != checksums[block.block_id]
            ):
                detail = (
                    f"content checksum {checksums[block.block_id]:#x} differs from the "
                    f"{block.checksum:#x} recorded when the block was written"
                )
            if detail is not None:
                self.counters.corruption_detections += 1
                raise CacheCorruption(request_id, block.block_id, epoch, block.epoch, detail)

    def record_checksum(self, block_id: int, checksum: int) -> None:
        """Remember a checksum of a block's written KV (fed by the model layer, optional)."""
        self.pool.blocks[block_id].checksum = checksum

    def audit(self, live_request_ids: Collection[str] | None = None) -> AuditReport:
        """Check every invariant in O(num_blocks + table entries); see `run_audit`.

        With `live_request_ids` (the engine's view), a ledger entry for any other request is a
        leak. The report is structured; it never raises.
        """
        report = run_audit(self.pool, self.ledger, live_request_ids, self.pending)
        self.counters.audit_runs += 1
        if not report.ok:
            self.counters.audit_failures += 1
        return report

    def check_idle(self) -> AuditReport:
        """The idle check: with no live request, zero blocks may be held."""
        return self.audit(live_request_ids=())

    def reap(
        self,
        idle_timeout_s: float | None = None,
        live_request_ids: Collection[str] | None = None,
    ) -> list[str]:
        """Free what nobody will free: requests not in `live_request_ids` (the engine's view),
        and requests holding blocks idle for longer than `idle_timeout_s`. Counts the requests
        and blocks reclaimed; returns the reaped request ids."""
        now = self._clock()
        live = None if live_request_ids is None else set(live_request_ids)
        reaped = [
            r for r in self.ledger
            if (live is not None and r.request_id not in live)
            or (idle_timeout_s is not None and r.block_table
                and now - r.last_active > idle_timeout_s)
        ]
        for record in reaped:
            self.counters.reclaimed_blocks += self.free(record.request_id, FreeReason.REAPED)
            self.counters.reaped_requests += 1
        return [r.request_id for r in reaped]

    # -- views ----------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self._record(request_id).block_ids

    def num_computed_tokens(self, request_id: str) -> int:
        return self._record(request_id).num_computed_tokens

    def has_request(self, request_id: str) -> bool:
        return request_id in self.ledger

    def ledger_summary(self) -> list[LedgerEntry]:
        return self.ledger.summary(self._clock())

    def stats(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free,
            num_held_blocks=pool.num_blocks - pool.num_free_blocks,
            num_live_requests=len(self.ledger),
            counters=replace(self.counters, frees_by_reason=dict(self.counters.frees_by_reason)),
        )

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # -- internals ------------------------------------------------------------------------

    def _record(self, request_id: str) -> RequestRecord:
        record = self.ledger.get(request_id)
        if record is None:
            raise UnknownRequest(f"request {request_id!r} is not in the cache (not added or freed)")
        return record

    def _mark_pending(self, record: RequestRecord) -> None:
        """Announce the full blocks this request was given room for and will now compute
        (hashes known from its lookup), unless cached or already announced by someone."""
        first = record.num_computed_tokens // self.block_size
        last = min(len(record.block_table), len(record.token_ids) // self.block_size)
        self._ensure_hashes(record, last)
        owned = set(record.pending_hashes)
        for idx in range(first, last):
            block_hash = record.block_hashes[idx]
            if block_hash in owned or block_hash in self.pool.cached:
                continue
            if self.pending.setdefault(block_hash, record.request_id) == record.request_id:
                record.pending_hashes.append(block_hash)

    def _unmark_pending(self, record: RequestRecord, hashes: list[bytes]) -> None:
        if not hashes:
            return
        gone = set(hashes)
        for block_hash in gone:
            if self.pending.get(block_hash) == record.request_id:
                del self.pending[block_hash]
        record.pending_hashes = [h for h in record.pending_hashes if h not in gone]

    def _adopt_cached_twin(self, record: RequestRecord, idx: int) -> None:
        """Block `idx` duplicates content another block already caches (two requests computed
        the same prefix at once). Switch the table to the cached twin and release the duplicate,
        so the request's chain stays one chain and deepest-first release keeps prefixes whole."""
        twin = self.pool.cached[record.block_hashes[idx]]
        duplicate = record.block_table[idx]
        self.pool.touch([twin], record.request_id)
        record.block_table[idx] = twin
        record.block_epochs[idx] = twin.epoch
        self.pool.free([duplicate])

    def _ensure_hashes(self, record: RequestRecord, num_full_blocks: int) -> None:
        """Extend the request's chained block hashes to cover `num_full_blocks` full blocks."""
        hashes, token_bytes = record.block_hashes, record.block_token_bytes
        first = len(hashes)
        if first >= num_full_blocks:
            return
        # One encoding for all new blocks, sliced per block: far cheaper than one per block.
        bs = self.block_size
        new_hashes, new_bytes = chain_hashes(
            hashes[-1] if hashes else ROOT_HASH,
            encode_tokens(record.token_ids[first * bs : num_full_blocks * bs]),
            bs * TOKEN_WIDTH,
            None if hashes else record.root_extra,
        )
        hashes.extend(new_hashes)
        token_bytes.extend(new_bytes)
