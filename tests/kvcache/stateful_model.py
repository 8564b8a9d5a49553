"""The engine's model for the stateful cache test, and the checks of the cache against it.

The model is what an engine knows: its live requests, the ones it forgot (leaks), the hits it
stashed, what each tenant has written and committed, and the cache as an external indexer sees
it from the KV events. With a host tier, a commit means the step ran: its copies between the
tiers are confirmed first, as the engine does. With swapping, a swapped-out request holds no
block, only host slots private to it, until it is swapped back in. Its steps (`allocate`,
`commit`) check each call's contract; its `check_*` methods are the invariants the state
machine asserts after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import event

from kvserve.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FreeReason,
    ImportState,
    KVCacheManager,
    PrefixHit,
    ViolationKind,
)
from kvserve.kvcache.host_tier import SlotState
from tests.kvcache.conftest import FakeClock

TENANTS = (None, "tenant-a", "tenant-b")


def snapshot(manager: KVCacheManager) -> dict[str, object]:
    """What a refused allocation, a lookup or a redundant free must leave as it was. The
    `redundant_frees` counter is left out: it counts the redundant free."""
    pool = manager.pool
    stats = manager.stats()
    counters = replace(stats.counters, redundant_frees=0)
    host = manager.transfers.host if manager.transfers else None
    disk = manager.transfers.disk if manager.transfers else None
    return {
        "host_slots": host and [(s.state, s.epoch, s.pin_cnt, s.block_hash, s.owner)
                                for s in host.slots],
        "host_lru": host and host.lru_slot_ids(),
        "disk_slots": disk and [(s.state, s.epoch, s.pin_cnt, s.block_hash) for s in disk.slots],
        "disk_lru": disk and disk.lru_slot_ids(),
        "refcounts": [b.ref_cnt for b in pool.blocks],
        "epochs": [b.epoch for b in pool.blocks],
        "hashes": [b.block_hash for b in pool.blocks],
        "free_queue": pool.free_queue.block_ids(),
        "hash_map": {key: b.block_id for key, b in pool.cached.items()},
        "stats": replace(stats, counters=counters),
        "ledger": {
            r.request_id: (tuple(r.block_ids), r.num_computed_tokens, r.last_active,
                           tuple(r.swap_slots))
            for r in manager.ledger
        },
    }


def assert_unchanged(before: dict[str, object], after: dict[str, object], what: str) -> None:
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    assert not changed, f"{what} changed state: {changed}"


@dataclass
class Req:
    """The engine's view of one request."""

    tokens: list[int]
    salt: str | None
    last_active: float
    admitted: bool = False
    computed: int = 0  # tokens whose KV is written (committed)
    scheduled: int = 0  # tokens with slots
    swapped: bool = False  # swapped out: no blocks, its KV in private host slots


class EngineModel:
    """The engine's record of its requests next to the cache it drives; checks them against
    each other. It never decides what happens next: the state machine does."""

    def __init__(self, num_blocks: int, block_size: int, num_host_slots: int = 0,
                 num_disk_slots: int = 0) -> None:
        self.clock = FakeClock()
        self.mgr = KVCacheManager(num_blocks, block_size, clock=self.clock, enable_events=True,
                                  num_host_slots=num_host_slots, num_disk_slots=num_disk_slots)
        self.num_blocks, self.bs = num_blocks, block_size
        self.live: dict[str, Req] = {}
        self.abandoned: dict[str, Req] = {}  # the engine forgot them; the cache still holds them
        self.stash: dict[str, PrefixHit] = {}  # hits looked up earlier in the step
        # (salt, block-aligned token prefix) whose KV a request of that salt wrote and committed.
        self.written: set[tuple[str | None, tuple[int, ...]]] = set()
        self.index: set[bytes] = set()  # the cache as an external indexer sees it from KV events
        self.num_removed = 0  # hashes in BlockRemoved events
        self.next_id = 0
        self.open_imports: set[str] = set()  # KV imports whose transfer is still running

    # -- the engine's steps, each checked against the call's contract -----------------------

    def waiting(self) -> list[str]:
        return [rid for rid, r in self.live.items() if not r.admitted]

    def stashed(self) -> list[str]:
        return [rid for rid in self.waiting() if rid in self.stash]

    def prefilling(self) -> list[str]:
        """Admitted requests with prompt (or refused decode) tokens still to compute."""
        return [rid for rid, r in self.live.items()
                if r.admitted and not r.swapped and r.computed < len(r.tokens)]

    def decoding(self) -> list[str]:
        """Admitted requests whose every token is computed: ready for the next one."""
        return [rid for rid, r in self.live.items()
                if r.admitted and not r.swapped and r.computed == len(r.tokens)]

    def swapped(self, resumable: bool = False) -> list[str]:
        """Swapped-out live requests (`resumable`: their swap-out copies are confirmed)."""
        transfers = self.mgr.transfers
        return [rid for rid, r in self.live.items() if r.swapped and not (
            resumable and transfers is not None and any(
                slot_id in transfers.swap_stores
                for slot_id, _ in self.mgr.ledger.get(rid).swap_slots))]

    def num_blocks_held(self, req: Req) -> int:
        return 0 if req.swapped else self.num_blocks_for(req.scheduled)
    def touch(self, req: Req) -> None:
        req.last_active = self.clock.now

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def run_step(self) -> None:
        """The model runs the copies scheduled since the last step; they are confirmed."""
        transfers = self.mgr.take_transfers()
        if transfers:
            event("host tier copies confirmed")
        self.mgr.complete_transfers(transfers)

    def settle_if_idle(self) -> None:
        """When the last request ends mid-step, the engine still runs the copies it scheduled
        (offloads read blocks before they are reused), then goes idle."""
        if not self.live and not self.abandoned:
            self.run_step()

    def fail_step(self) -> None:
        """The step fails: its copies are undone and requests with missing loads end."""
        for rid in self.mgr.cancel_transfers(self.mgr.take_transfers()):
            event("failed step ended a loading request")
            self.mgr.free(rid, FreeReason.ERROR)
            self.live.pop(rid, None)
            self.abandoned.pop(rid, None)
            self.stash.pop(rid, None)
        for requests in (self.live, self.abandoned):
            for rid, req in list(requests.items()):
                if req.swapped and not self.mgr.has_request(rid):  # its swap-out was lost
                    event("failed step lost a swap-out: recompute")
                    del requests[rid]
                    if requests is self.live:  # the engine queues it again, all tokens kept
                        self.mgr.add_request(rid, req.tokens, cache_salt=req.salt)
                        self.live[rid] = Req(list(req.tokens), req.salt, self.clock.now)

    def commit(self, rid: str, upto: int) -> None:
        req = self.live[rid]
        self.run_step()  # the step that computed these tokens ran its copies first
        self.mgr.commit(rid, upto)
        req.computed = upto
        self.touch(req)
        for k in range(1, upto // self.bs + 1):
            self.written.add((req.salt, tuple(req.tokens[: k * self.bs])))

    def allocate(self, rid: str, num_new: int, hit: PrefixHit | None = None) -> bool:
        """allocate_slots; a refusal must change nothing, statistics included."""
        mgr = self.mgr
        before, counters = snapshot(mgr), mgr.stats().counters
        out = mgr.allocate_slots(rid, num_new, hit)
        if out is None:
            event("allocation refused")
            assert_unchanged(before, snapshot(mgr), f"refused allocate_slots({rid!r}, {num_new})")
            return False
        req = self.live[rid]
        if hit is not None:
            assert out.num_cached_tokens == hit.num_tokens
            after = mgr.stats().counters
            assert after.prefix_queries_tokens == counters.prefix_queries_tokens + len(req.tokens)
            assert after.prefix_hits_tokens == counters.prefix_hits_tokens + hit.num_tokens
            assert mgr.block_table(rid)[: len(hit.block_ids)] == list(hit.block_ids)
            req.admitted, req.computed = True, hit.num_tokens
        req.scheduled = max(req.scheduled, req.computed + num_new)
        self.touch(req)
        assert len(mgr.block_table(rid)) == self.num_blocks_for(req.scheduled)
        return True

    def check_hit(self, rid: str, hit: PrefixHit) -> None:
        req, pool = self.live[rid], self.mgr.pool
        num_device = len(hit.block_ids)
        num = num_device + len(hit.host_slots) + len(hit.disk_slots)
        assert hit.num_tokens == num * self.bs and len(hit.epochs) == num_device
        assert hit.num_tokens < len(req.tokens), "the hit must leave a prompt token to compute"
        assert list(hit.epochs) == [pool.blocks[b].epoch for b in hit.block_ids]
        if hit.host_slots:
            host = self.mgr.transfers.host
            assert list(hit.host_epochs) == [host.slots[s].epoch for s in hit.host_slots]
            assert all(host.slots[s].salt == req.salt for s in hit.host_slots)
            event("host tier hit")
        if hit.disk_slots:
            disk = self.mgr.transfers.disk
            assert list(hit.disk_epochs) == [disk.slots[s].epoch for s in hit.disk_slots]
            assert all(disk.slots[s].salt == req.salt for s in hit.disk_slots)
            assert len(hit.from_disk) == num - num_device
            assert sum(hit.from_disk) == len(hit.disk_slots)
            event("disk tier hit")
        for k in range(1, num + 1):
            key = (req.salt, tuple(req.tokens[: k * self.bs]))
            assert key in self.written, (
                f"{rid} (salt {req.salt!r}) got a hit on block {hit.block_ids[k - 1]} whose "
                "content no request of its tenant ever wrote"
            )
        assert all(pool.blocks[b].salt == req.salt for b in hit.block_ids)
        if num:
            event("prefix hit")
        elif any(
            (salt, tuple(req.tokens[: self.bs])) in self.written
            for salt in TENANTS
            if salt != req.salt
        ):
            event("cross-tenant attempt: no hit")

    # -- invariants, after every step -------------------------------------------------------

    def check_books_balance(self) -> None:
        mgr = self.mgr
        report = mgr.audit(live_request_ids={*self.live, *self.abandoned})
        stats = mgr.stats()
        assert report.ok, report.describe()
        census = report.num_free_uncached + report.num_free_cached + report.num_held
        assert census == self.num_blocks, report.describe()
        if report.host is not None:
            host = report.host
            assert (host.num_free + host.num_storing + host.num_ready + host.num_swapped
                    == host.num_slots)
            assert stats.host is not None and stats.host.num_ready_slots == host.num_ready
            swap_slots = sum(len(r.swap_slots) for r in mgr.ledger)
            assert host.num_swapped == stats.host.num_swapped_slots == swap_slots
        if report.disk is not None:
            disk = report.disk
            assert disk.num_free + disk.num_storing + disk.num_ready == disk.num_slots
            assert stats.disk is not None and stats.disk.num_ready_slots == disk.num_ready
        assert stats.num_free_blocks == report.num_free_uncached + report.num_free_cached
        assert stats.num_cached_free_blocks == report.num_free_cached
        assert stats.num_held_blocks == report.num_held
        assert stats.num_live_requests == len(self.live) + len(self.abandoned)

    def check_leaks_are_named(self) -> None:
        report = self.mgr.audit(live_request_ids=set(self.live))
        leaked = {v.request_id for v in report.violations if v.kind is ViolationKind.LEAK}
        assert leaked == set(self.abandoned), report.describe()
        imports = self.mgr.imports
        held_slots = set() if imports is None else {
            s.slot_id for s in imports.host.slots if s.pin_cnt or s.state is SlotState.STORING}
        for imp in imports.imports.values() if imports is not None else ():
            if imp.state is ImportState.OPEN:  # its transfer is still running: not idle-held
                held_slots -= {*imp.pinned, *imp.reserved}
        disk = report.disk
        disk_held = disk is not None and (disk.num_storing > 0 or disk.num_pinned > 0)
        held_while_idle = not self.live and (report.num_held > 0 or bool(held_slots)
                                             or disk_held)
        expected = {ViolationKind.LEAK} if self.abandoned else set()
        expected |= {ViolationKind.HELD_WHILE_IDLE} if held_while_idle else set()
        if imports is not None and any(
                rid in imports.imports and imports.imports[rid].state is ImportState.ATTACHED
                for rid in self.abandoned):
            expected.add(ViolationKind.IMPORT_LEAK)
        assert report.kinds() == expected, report.describe()

    def check_requests_verify_and_match(self) -> None:
        for rid, req in {**self.live, **self.abandoned}.items():
            self.mgr.verify(rid)
            assert self.mgr.num_computed_tokens(rid) == req.computed
            assert len(self.mgr.block_table(rid)) == self.num_blocks_held(req)
            assert self.mgr.is_swapped(rid) is req.swapped
            if req.swapped:
                swap_slots = self.mgr.ledger.get(rid).swap_slots
                assert len(swap_slots) == self.num_blocks_for(req.computed)

    def check_kv_events(self) -> None:
        for kv_event in self.mgr.drain_events():
            if isinstance(kv_event, BlockStored):
                assert not self.index & set(kv_event.block_hashes), "stored twice without removal"
                self.index |= set(kv_event.block_hashes)
            elif isinstance(kv_event, BlockRemoved):
                assert set(kv_event.block_hashes) <= self.index, "removed a block never stored"
                self.index -= set(kv_event.block_hashes)
                self.num_removed += len(kv_event.block_hashes)
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                self.index.clear()
        assert self.index == set(self.mgr.pool.cached)
        assert self.num_removed == self.mgr.stats().counters.evicted_blocks

    def check_free_queue_order(self) -> None:
        """Freed uncached blocks go to the head, freed cached ones to the tail: every cached
        free block is evicted only after all uncached free blocks are used."""
        cached = [b.is_cached for b in self.mgr.pool.free_queue]
        assert cached == sorted(cached), self.mgr.pool.free_queue.block_ids()

    def check_teardown(self) -> None:
        """Aborting everything left leaves the cache idle with every block free."""
        for rid in [*self.live, *self.abandoned]:
            self.mgr.free(rid, FreeReason.ABORTED)
        for import_id in list(self.open_imports):
            self.mgr.imports.cancel(import_id)  # type: ignore[union-attr]
        self.run_step()  # offloads scheduled before the aborts still run
        idle = self.mgr.check_idle()
        assert idle.ok, idle.describe()
        assert self.mgr.stats().num_free_blocks == self.num_blocks
        assert sorted(self.mgr.pool.free_queue.block_ids()) == list(range(self.num_blocks))
