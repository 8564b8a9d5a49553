"""The request-level KV cache manager: the only API the engine uses.

Life of a request: `add_request` → `lookup` (read-only) → `allocate_slots` (all-or-nothing, may
consume the lookup's hit) → the model writes KV → `commit` (full blocks become shareable) → more
`append_token_ids` / `allocate_slots` / `commit` while decoding → `free` (one path for every
ending, idempotent). `verify` before a step proves no block was reassigned under the request.
With a host tier (and a disk tier under it), each step's copies: `take_transfers` → the model
→ `complete_transfers`. With a host tier, a running request can be preempted by swapping
(`swap_out`, later `swap_in`; see swapping.py) instead of being freed and recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from kvserve.kvcache.allocation import allocate_record_slots, commit_record
from kvserve.kvcache.audit import AuditReport, run_audit
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.errors import UnknownRequest
from kvserve.kvcache.events import KVEvent
from kvserve.kvcache.hashing import encode_extra_keys
from kvserve.kvcache.host_audit import audit_tiers
from kvserve.kvcache.host_tier import HostTier, SlotPool
from kvserve.kvcache.idle_check import merge_reports, quick_idle_report
from kvserve.kvcache.imports import KVImports
from kvserve.kvcache.ledger import Ledger, LedgerEntry, RequestRecord
from kvserve.kvcache.prefix_hits import find_prefix_hit
from kvserve.kvcache.publishing import withdraw
from kvserve.kvcache.stats import KVCacheCounters, KVCacheStats
from kvserve.kvcache.step_copies import cancel_step_copies, complete_step_copies
from kvserve.kvcache.swapping import start_swap_in, start_swap_out
from kvserve.kvcache.transfers import KVTransfers, TransferLedger
from kvserve.kvcache.types import FreeReason, PrefixHit, SlotAllocation


class KVCacheManager:
    """Paged KV cache with automatic prefix caching for many requests and tenants. Pure
    bookkeeping (no tensors): which physical blocks hold which tokens. Single threaded: the
    engine's step loop owns it. Contracts: DESIGN.md, "Invariants of the KV cache"."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        enable_events: bool = False,
        model_id: str = "",
        num_host_slots: int = 0,
        num_disk_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_disk_slots and not num_host_slots:
            raise ValueError("a disk tier keeps what the host tier evicts, so it needs a host "
                             "tier; give num_host_slots > 0 or num_disk_slots=0")
        self.counters = KVCacheCounters()
        # The host tier (None: off) keeps what the pool evicts; the disk tier what the host does.
        disk = SlotPool(num_disk_slots, name="disk") if num_disk_slots else None
        self.transfers = (TransferLedger(HostTier(num_host_slots), disk) if num_host_slots
                          else None)
        self.pool = BlockPool(num_blocks, block_size, self.counters, enable_events=enable_events,
                              on_evict=self.transfers.offload if self.transfers else None)
        # KV received from a prefill worker lands in the host tier (None without one).
        self.imports = (KVImports(self.pool, self.transfers.host, model_id, clock)
                        if self.transfers else None)
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
        adapter_digest: bytes | None = None,
    ) -> None:
        """Start tracking a request with its prompt. `cache_salt` isolates tenants: requests
        with different salts never share a block. It must come from a trusted layer.
        `adapter_digest`: the sha256 of the LoRA adapter's weights and config (None: the base
        model); requests of different adapters never share a block, equal files always may."""
        now = self._clock()
        self.ledger.add(
            RequestRecord(
                request_id=request_id,
                token_ids=list(token_ids),
                salt=cache_salt,
                root_extra=encode_extra_keys(self.model_id, adapter_digest, cache_salt),
                adapter_digest=adapter_digest,
                created_at=now,
                last_active=now,
            )
        )

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Extend a request's sequence with generated tokens (their KV is written later)."""
        record = self._record(request_id)
        record.token_ids.extend(token_ids)
        record.last_active = self._clock()

    def lookup(self, request_id: str, in_flight: Mapping[str, int] | None = None) -> PrefixHit:
        """The longest cached head of the request's tokens: device blocks, then READY host
        slots, then READY disk slots. Read-only: changes no refcount, queue position, pin or hit
        statistic (a refused hash collision is counted). Capped so that at least one token is
        left to compute.

        `in_flight`: requests planned into the step being scheduled -> tokens whose KV it will
        have written; a device-only head then also takes the prompt blocks they write in it.
        Such a hit is for that step only: the joiner must run in the same forward pass as its
        `in_flight_owners` (each layer writes the step's K/V before any token attends), and be
        freed and recomputed if an owner leaves the step or the step fails."""
        record = self._record(request_id)
        if not self.enable_prefix_caching or record.block_table or record.swap_slots:
            return PrefixHit()
        return find_prefix_hit(self.pool, self.transfers, self.pending, record, in_flight,
                               self.ledger)

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` more tokens after those already computed, taking
        `prefix_hit` (from `lookup`) on the first allocation (allocation.py). None when there
        is not enough free space, and then nothing has changed."""
        record = self._record(request_id)
        new_blocks = allocate_record_slots(self.pool, self.transfers, self.imports, self.pending,
                                           self.counters, record, num_new_tokens, prefix_hit,
                                           self.enable_prefix_caching)
        if new_blocks is None:
            return None
        record.last_active = self._clock()
        return SlotAllocation(tuple(b.block_id for b in new_blocks), record.num_cached_tokens)

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """The model has written KV for the first `num_computed_tokens` tokens. Full blocks among
        them become shareable now, never earlier (a hash is published only over written KV)."""
        record = self._record(request_id)
        commit_record(self.pool, self.pending, self.counters, record, num_computed_tokens,
                      self.enable_prefix_caching)
        record.last_active = self._clock()

    def free(self, request_id: str, reason: FreeReason = FreeReason.FINISHED) -> int:
        """Release everything the request holds; the one path for every ending. Idempotent:
        freeing an unknown or already-freed request does nothing and returns 0."""
        if self.imports is not None:
            self.imports.release(request_id)  # ended before admission: imported KV unpinned
        record = self.ledger.pop(request_id)
        if record is None:
            self.counters.redundant_frees += 1
            return 0
        if self.transfers is not None:
            self.transfers.cancel_request(request_id)  # unpublished loads: never readable
            self.transfers.release_swap(record.swap_slots)  # a swapped-out request's KV
        withdraw(self.pending, record, list(record.pending_hashes))
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
        released (refcount 0), a host slot it is about to load from was reassigned or is not
        READY, or, when `checksums` are given, a block holds different content than the
        checksum recorded when it was written.
        """
        record = self._record(request_id)
        if self.transfers is not None and (corruption := self.transfers.check_loads(request_id)):
            self.counters.corruption_detections += 1
            raise corruption
        if (corruption := record.find_corruption(checksums)) is not None:
            self.counters.corruption_detections += 1
            raise corruption

    def record_checksum(self, block_id: int, checksum: int) -> None:
        """Remember a checksum of a block's written KV (fed by the model layer, optional)."""
        self.pool.blocks[block_id].checksum = checksum

    def audit(self, live_request_ids: Collection[str] | None = None) -> AuditReport:
        """Check every invariant in O(num_blocks + table entries) (`run_audit`, `audit_tiers`);
        with `live_request_ids` (the engine's view), any other request's entry is a leak."""
        report = run_audit(self.pool, self.ledger, live_request_ids, self.pending)
        if self.transfers is not None:
            report = audit_tiers(report, self.transfers, self.ledger, live_request_ids,
                                 self.imports)
        self.counters.audit_runs += 1
        if not report.ok:
            self.counters.audit_failures += 1
        return report

    def check_idle(self) -> AuditReport:
        """The idle check with the full audit: with no live request, no block may be held."""
        return self.audit(live_request_ids=())

    def check_idle_quick(self) -> AuditReport:
        """The idle check from counts, O(live) (idle_check.py); if it finds anything, the full
        audit runs too and names every culprit in the returned report."""
        self.counters.idle_checks += 1
        quick = quick_idle_report(self.pool, self.ledger, self.pending, self.transfers,
                                  self.imports)
        return quick if quick.ok else merge_reports(self.check_idle(), quick)

    def reap(
        self,
        idle_timeout_s: float | None = None,
        live_request_ids: Collection[str] | None = None,
    ) -> list[str]:
        """Free what nobody will free: requests not in `live_request_ids` (the engine's view),
        and requests holding blocks idle for longer than `idle_timeout_s`. Counts the requests
        and blocks reclaimed; returns the reaped request ids."""
        reaped = self.ledger.abandoned(self._clock(), idle_timeout_s, live_request_ids)
        if self.imports is not None:  # host slots, not blocks: counted as cancelled imports
            self.imports.reap(self._clock(), idle_timeout_s, live_request_ids)
        for record in reaped:
            self.counters.reclaimed_blocks += self.free(record.request_id, FreeReason.REAPED)
            self.counters.reaped_requests += 1
        return [r.request_id for r in reaped]

    # -- views ----------------------------------------------------------------------------
    def num_blocks_to_grow(self, request_ids: Iterable[str], num_more_tokens: int) -> int:
        """New blocks these requests' tables need to hold their tokens plus `num_more_tokens`
        more each: what that many further one-token steps allocate (read-only)."""
        return sum(record.num_blocks_needed(len(record.token_ids) + num_more_tokens,
                                            self.block_size)
                   for record in map(self._record, request_ids))

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
            host=self.transfers.host.stats() if self.transfers else None,
            disk=self.transfers.disk.stats() if self.transfers and self.transfers.disk else None,
        )

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block in every tier; refused (False) while a block is held, a
        request swapped out, an import open or a copy between the tiers unconfirmed."""
        tiers = self.transfers
        busy_imports = self.imports is not None and bool(self.imports.imports)
        if (tiers is not None and (not tiers.is_idle or tiers.host.private)) or busy_imports:
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if tiers is not None:
            assert tiers.host.clear(), "an idle host tier can always be cleared"
            assert tiers.disk is None or tiers.disk.clear(), "an idle disk tier too"
        return True

    # -- preemption by swapping -----------------------------------------------------------
    def swap_out(self, request_id: str) -> bool:
        """Preempt by swapping (swapping.py): the request's computed KV is copied to host slots
        private to it and its device blocks are released; it stays live, its computed tokens
        kept. False, changing nothing, when it cannot be swapped (no host tier, nothing
        computed, or too few host slots: counted as a fallback); the caller then frees it."""
        return start_swap_out(self.pool, self.transfers, self.pending,
                              self._record(request_id), self.counters)

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request is swapped out (resume it with `swap_in`, not `allocate_slots`)."""
        record = self.ledger.get(request_id)
        return record is not None and bool(record.swap_slots) and not record.block_table

    def swap_in(self, request_id: str, num_new_tokens: int) -> SlotAllocation | None:
        """Resume a swapped-out request with room for `num_new_tokens` more tokens: fresh
        blocks, loads from its private slots (its KV is readable after `complete_transfers`).
        None, changing nothing, when too few blocks are free."""
        record = self._record(request_id)
        assert self.transfers is not None and self.is_swapped(request_id), f"{request_id} swap"
        blocks = start_swap_in(self.pool, self.transfers, self.pending, record, num_new_tokens,
                               self.enable_prefix_caching, self.counters)
        if blocks is None:
            return None
        record.last_active = self._clock()
        return SlotAllocation(tuple(b.block_id for b in blocks), record.num_cached_tokens)

    # -- copies between the tiers ---------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        """The copies the allocations since the last take scheduled: this step's."""
        return self.transfers.take() if self.transfers else KVTransfers()

    def complete_transfers(self, transfers: KVTransfers) -> None:
        """The step that ran `transfers` completed: stored slots become READY (or SWAPPED) and
        loaded blocks are published (hit-able), never earlier."""
        complete_step_copies(self, transfers)

    def cancel_transfers(self, transfers: KVTransfers) -> set[str]:
        """The step that was to run `transfers` failed: nothing it copied becomes readable and
        every pin is released. A request whose swap-out it carried is freed (its KV is lost:
        the caller recomputes it, and sees `has_request` False). Returns the requests whose
        loaded KV is missing; the caller must end them (free is the one path)."""
        return cancel_step_copies(self, transfers)

    # -- internals ------------------------------------------------------------------------
    def _record(self, request_id: str) -> RequestRecord:
        record = self.ledger.get(request_id)
        if record is None:
            raise UnknownRequest(f"request {request_id!r} is not in the cache (not added or freed)")
        return record

