"""The request-level KV cache manager: the only API the engine uses.

Life of a request: `add_request` → `lookup` (read-only) → `allocate_slots` (all-or-nothing, may
consume the lookup's hit) → the model writes KV → `commit` (full blocks become shareable) → more
`append_token_ids` / `allocate_slots` / `commit` while decoding → `free` (one path for every
ending, idempotent). `verify` before a step proves no block was reassigned under the request.
With a host tier, each step's copies: `take_transfers` → the model → `complete_transfers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from kvserve.kvcache.audit import AuditReport, run_audit
from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.errors import UnknownRequest
from kvserve.kvcache.events import KVEvent
from kvserve.kvcache.hashing import encode_extra_keys
from kvserve.kvcache.host_audit import audit_host_tier
from kvserve.kvcache.host_tier import HostSlot, HostTier
from kvserve.kvcache.idle_check import merge_reports, quick_idle_report
from kvserve.kvcache.imports import KVImports
from kvserve.kvcache.ledger import Ledger, LedgerEntry, RequestRecord
from kvserve.kvcache.publishing import announce, publish, withdraw
from kvserve.kvcache.stats import KVCacheCounters, KVCacheStats
from kvserve.kvcache.transfers import KVTransfers, TransferLedger
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
        num_host_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = KVCacheCounters()
        # The host tier under the pool (None: off): evicted cached blocks are offloaded to it.
        self.transfers = TransferLedger(HostTier(num_host_slots)) if num_host_slots else None
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
        """The longest cached head of the request's tokens: device blocks, then READY host
        slots. Read-only: changes no refcount, queue position, pin or hit statistic (a refused
        hash collision is counted). Capped so that at least one token is left to compute."""
        record = self._record(request_id)
        if not self.enable_prefix_caching or record.block_table:
            return PrefixHit()
        max_blocks = (len(record.token_ids) - 1) // self.block_size
        record.extend_hashes(max_blocks, self.block_size)
        hit: list[KVBlock] = []
        for idx in range(max_blocks):
            block = self.pool.get_cached_block(
                record.block_hashes[idx], record.block_token_bytes[idx]
            )
            if block is None:
                break
            hit.append(block)
        host_hit = self.transfers.find_hit(record, len(hit), max_blocks, self.pending) if (
            self.transfers) else []
        num_pending = 0
        for idx in range(len(hit) + len(host_hit), max_blocks):
            if self.pending.get(record.block_hashes[idx]) in (None, request_id):
                break
            num_pending += 1
        return PrefixHit(
            block_ids=tuple(b.block_id for b in hit),
            epochs=tuple(b.epoch for b in hit),
            num_tokens=(len(hit) + len(host_hit)) * self.block_size,
            num_pending_tokens=num_pending * self.block_size,
            host_slots=tuple(s.slot_id for s in host_hit),
            host_epochs=tuple(s.epoch for s in host_hit),
        )

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` more tokens after those already computed.

        On the first allocation `prefix_hit` (from `lookup`) is taken: its blocks join the table
        and its tokens count as computed; its host slots get fresh blocks and scheduled loads
        (published after `complete_transfers`). Returns None when there is not enough free space,
        and then nothing has changed: no refcount, queue position, map entry, pin or counter.
        """
        # Invariant: capacity is checked before any block is touched (all-or-nothing).
        record = self._record(request_id)
        hit_blocks: list[KVBlock] = []
        host_slots: list[HostSlot] = []
        if prefix_hit is not None and (prefix_hit.block_ids or prefix_hit.host_slots):
            if record.block_table:
                raise ValueError(f"request {request_id!r}: a prefix hit is only taken at admission")
            hit_blocks = [self.pool.blocks[i] for i in prefix_hit.block_ids]
            host_slots = [self._host.slots[i] for i in prefix_hit.host_slots]
            # A hit must still be the very content this request hashed, at the epoch seen.
            record.extend_hashes(len(hit_blocks) + len(host_slots), self.block_size)
            expected = record.block_hashes[: len(hit_blocks)]
            if [b.epoch for b in hit_blocks] != list(prefix_hit.epochs) or any(
                b.block_hash != h for b, h in zip(hit_blocks, expected, strict=True)
            ) or (host_slots and not self._host.is_fresh(
                host_slots, prefix_hit.host_epochs, record.block_hashes[len(hit_blocks) :]
            )):
                raise ValueError(f"request {request_id!r}: stale prefix hit; call lookup again")
        num_hit_blocks = len(hit_blocks) + len(host_slots)
        num_computed = record.num_computed_tokens + num_hit_blocks * self.block_size
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
        for slot in host_slots:  # pinned before the pool evicts (and offloads) anything
            self._host.pin(slot)
        new_blocks = self.pool.allocate(num_needed, request_id)
        assert new_blocks is not None, "free count checked above"
        if is_admission and self.imports is not None:
            self.imports.release(request_id)  # its loads pin what it needs now
        for block in (*hit_blocks, *new_blocks):
            record.block_table.append(block)
            record.block_epochs.append(block.epoch)
        for offset, slot in enumerate(host_slots):
            assert self.transfers is not None
            self.transfers.load(request_id, len(hit_blocks) + offset, new_blocks[offset], slot)
        if num_hit_blocks:
            record.num_computed_tokens = num_computed
            record.num_cached_tokens = num_computed
        if is_admission and self.enable_prefix_caching:
            self.counters.prefix_queries_tokens += len(record.token_ids)
            self.counters.prefix_hits_tokens += record.num_cached_tokens
        if host_slots:
            self._host.counters.hit_blocks += len(host_slots)
            self._host.counters.hit_tokens += len(host_slots) * self.block_size
        if self.enable_prefix_caching:
            # Loaded blocks are announced too: until published, a twin request waits for them.
            first = (len(hit_blocks) if host_slots
                     else record.num_computed_tokens // self.block_size)
            announce(self.pending, self.pool, record, first)
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
            withdraw(self.pending, record, record.block_hashes[first_new_full:num_full])
        record.last_active = self._clock()
        if not self.enable_prefix_caching or num_full <= first_new_full:
            return
        record.extend_hashes(num_full, self.block_size)
        for idx in range(first_new_full, num_full):
            block = record.block_table[idx]
            if block.block_hash is not None:
                # A prefix-hit block, already cached under this very hash. Any other hash is a
                # key left behind by a reuse: counted here, named by the audit, never hit (the
                # lookup refuses a block whose epoch moved on since it was cached).
                if block.block_hash != record.block_hashes[idx]:
                    self.counters.corruption_detections += 1
                continue
            publish(self.pool, record, idx)

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
        """Check every invariant in O(num_blocks + table entries); see `run_audit`.

        With `live_request_ids` (the engine's view), a ledger entry for any other request is a
        leak. The report is structured; it never raises.
        """
        report = run_audit(self.pool, self.ledger, live_request_ids, self.pending)
        if self.transfers is not None:
            host_violations, census = audit_host_tier(self.transfers, self.ledger,
                                                      live_request_ids, self.imports)
            report = replace(report, violations=report.violations + tuple(host_violations),
                             host=census)
        self.counters.audit_runs += 1
        if not report.ok:
            self.counters.audit_failures += 1
        return report

    def check_idle(self) -> AuditReport:
        """The idle check with the full audit: with no live request, zero blocks may be held."""
        return self.audit(live_request_ids=())

    def check_idle_quick(self) -> AuditReport:
        """The idle check from counts, O(live) (idle_check.py); if it finds anything, the full
        audit runs too and names every culprit in the returned report."""
        self.counters.idle_checks += 1
        quick = quick_idle_report(self.pool, self.ledger, self.pending, self.transfers)
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
        )

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block in both tiers; refused (False) while any block is held or
        any copy between the tiers is unconfirmed."""
        busy_imports = self.imports is not None and bool(self.imports.imports)
        if (self.transfers is not None and not self.transfers.is_idle) or busy_imports:
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if self.transfers is not None:
            assert self.transfers.host.clear(), "an idle host tier can always be cleared"
        return True

    # -- the host tier --------------------------------------------------------------------

    def take_transfers(self) -> KVTransfers:
        """The copies the allocations since the last take scheduled: this step's transfers."""
        return self.transfers.take() if self.transfers else KVTransfers()

    def complete_transfers(self, transfers: KVTransfers) -> None:
        """The step that ran `transfers` completed: stored host slots become READY and loaded
        blocks are published (hit-able), never earlier."""
        if self.transfers is None:
            assert not transfers, "transfers without a host tier"
            return
        for load in self.transfers.complete(transfers):
            record = self.ledger.get(load.request_id)
            assert record is not None, "a freed request's loads are cancelled at free"
            withdraw(self.pending, record, [record.block_hashes[load.block_idx]])
            publish(self.pool, record, load.block_idx)

    def cancel_transfers(self, transfers: KVTransfers) -> set[str]:
        """The step that was to run `transfers` failed: nothing it copied becomes readable and
        every pin is released. Returns the requests whose loaded KV is missing; the caller must
        end them (free is the one path)."""
        return self.transfers.cancel(transfers) if self.transfers else set()

    # -- internals ------------------------------------------------------------------------

    def _record(self, request_id: str) -> RequestRecord:
        record = self.ledger.get(request_id)
        if record is None:
            raise UnknownRequest(f"request {request_id!r} is not in the cache (not added or freed)")
        return record

    @property
    def _host(self) -> HostTier:
        if self.transfers is None:
            raise ValueError("a host-tier prefix hit, but this cache has no host tier")
        return self.transfers.host
