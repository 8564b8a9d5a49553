"""The audit: proves the books balance, in O(num_blocks + block-table entries).

Checks every invariant of DESIGN.md that is a property of state (1, 2, 4-8) and returns a
structured report naming each culprit: the block, the request, the expected and found values.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.ledger import Ledger


class ViolationKind(enum.Enum):
    FREE_QUEUE_BROKEN = "free_queue_broken"  # links, count or a block queued twice
    HELD_BLOCK_IN_FREE_QUEUE = "held_block_in_free_queue"
    LOST_BLOCK = "lost_block"  # refcount 0 but not in the free queue: can never be reused
    REFCOUNT_MISMATCH = "refcount_mismatch"  # refcount != number of tables listing the block
    DUPLICATE_IN_TABLE = "duplicate_in_table"  # one block handed out twice to one request
    HASH_MAP_MISMATCH = "hash_map_mismatch"  # map key and block's hash or tokens disagree
    STALE_HASH = "stale_hash"  # a block's hash does not describe the content its holder wrote
    CROSS_TENANT_SHARE = "cross_tenant_share"  # a block computed under one salt held under another
    # A block computed under one LoRA adapter (digest) and read under another.
    CROSS_ADAPTER_SHARE = "cross_adapter_share"
    EPOCH_MISMATCH = "epoch_mismatch"  # block reassigned under a live table
    UNCACHED_SHARE = "uncached_share"  # several tables list a block that caches nothing
    ORPHAN_BLOCK = "orphan_block"  # a cached block whose parent was evicted (invariant 8)
    STALE_PENDING = "stale_pending"  # a block announced as in progress by a request that is not
    LEAK = "leak"  # blocks held by a request the engine no longer runs
    HELD_WHILE_IDLE = "held_while_idle"  # no live request, yet blocks (or host slots) are held
    # The host tier (host_audit.py).
    HOST_TIER_BROKEN = "host_tier_broken"  # a slot's state, its index and the census disagree
    HOST_HASH_MISMATCH = "host_hash_mismatch"  # LRU key and slot's hash or tokens disagree
    HOST_READABLE_BEFORE_COPY = "host_readable_before_copy"  # READY while its copy is unconfirmed
    HOST_PIN_MISMATCH = "host_pin_mismatch"  # pins != in-flight loads reading the slot
    HOST_LOAD_MISMATCH = "host_load_mismatch"  # an in-flight load's slot or block changed under it
    IMPORT_LEAK = "import_leak"  # imported KV pinned for a request the engine no longer runs
    SWAP_MISMATCH = "swap_mismatch"  # a request's swap slot is not private to it at its epoch


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with the evidence."""

    kind: ViolationKind
    message: str
    block_id: int | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class HostCensus:
    """A tier's (host or disk) slots by state, as the audit counted them."""

    num_slots: int
    num_free: int
    num_storing: int
    num_ready: int
    num_pinned: int
    num_swapped: int = 0  # private to swapped-out requests (SWAPPING or SWAPPED)


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The audit's findings and the block census it was based on (`host`, `disk`: the tiers'
    censuses, None without them)."""

    num_blocks: int
    num_free_uncached: int
    num_free_cached: int
    num_held: int
    num_live_requests: int
    violations: tuple[Violation, ...] = field(default_factory=tuple)
    host: HostCensus | None = None
    disk: HostCensus | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[ViolationKind]:
        return {v.kind for v in self.violations}

    def describe(self) -> str:
        head = (
            f"audit: {self.num_held} held, {self.num_free_cached} free-cached, "
            f"{self.num_free_uncached} free-uncached of {self.num_blocks} blocks; "
            f"{self.num_live_requests} live requests"
        )
        if self.host is not None:
            h = self.host
            head += (f"; host tier: {h.num_ready} ready ({h.num_pinned} pinned), "
                     f"{h.num_storing} storing, {h.num_swapped} swap, {h.num_free} free of "
                     f"{h.num_slots} slots")
        if self.disk is not None:
            d = self.disk
            head += (f"; disk tier: {d.num_ready} ready ({d.num_pinned} pinned), "
                     f"{d.num_storing} storing, {d.num_free} free of {d.num_slots} slots")
        lines = [head] + [f"  {v.kind.value}: {v.message}" for v in self.violations]
        return "\n".join(lines if self.violations else [head + "; ok"])


MAX_VIOLATIONS = 100  # a broken pool can break everywhere; the first hundred name the cause


def run_audit(
    pool: BlockPool,
    ledger: Ledger,
    live_request_ids: Collection[str] | None = None,
    pending: Mapping[bytes, str] | None = None,
) -> AuditReport:
    """Audit `pool` against `ledger` (and the in-progress block announcements). Never mutates."""
    out: list[Violation] = []

    def fail(
        kind: ViolationKind, msg: str, block: int | None = None, req: str | None = None
    ) -> None:
        if len(out) < MAX_VIOLATIONS:
            out.append(Violation(kind, msg, block, req))

    # 1. The free queue: sound links, the right count, each block once, only free blocks.
    in_queue = bytearray(pool.num_blocks)
    seen = 0
    prev = pool.free_queue.head_sentinel
    for block in pool.free_queue:
        seen += 1
        if block.prev_free is not prev:
            fail(ViolationKind.FREE_QUEUE_BROKEN, f"block {block.block_id} has a bad back-link",
                 block.block_id)
        if in_queue[block.block_id]:
            fail(ViolationKind.FREE_QUEUE_BROKEN, f"block {block.block_id} is queued twice",
                 block.block_id)
            break
        in_queue[block.block_id] = 1
        if block.ref_cnt != 0:
            fail(ViolationKind.HELD_BLOCK_IN_FREE_QUEUE,
                 f"block {block.block_id} has refcount {block.ref_cnt} but is in the free queue",
                 block.block_id)
        prev = block
    if seen != pool.free_queue.num_free_blocks:
        fail(ViolationKind.FREE_QUEUE_BROKEN,
             f"free queue links {seen} blocks but counts {pool.free_queue.num_free_blocks}")

    # 2. Refcounts equal the number of block tables listing each block. One pass over the
    # blocks checks 1-2 and 4 per block; `holders` lists only held blocks, so an idle pool of
    # any size costs one loop and no allocation per block (the engine audits every drain).
    holders: dict[int, list[str]] = {}
    for record in ledger:
        ids = record.block_ids
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            fail(ViolationKind.DUPLICATE_IN_TABLE,
                 f"request {record.request_id!r} lists block {dup} twice", dup, record.request_id)
        for block_id in ids:
            holders.setdefault(block_id, []).append(record.request_id)
    num_free_uncached = num_free_cached = num_held = 0
    cached = pool.cached
    nobody: list[str] = []
    for block in pool.blocks:
        bid = block.block_id
        ref_cnt, block_hash = block.ref_cnt, block.block_hash
        held_by = holders.get(bid, nobody)
        if ref_cnt == 0:
            if block_hash is None:
                num_free_uncached += 1
            else:
                num_free_cached += 1
            if not in_queue[bid]:
                fail(ViolationKind.LOST_BLOCK, f"block {bid} is free but not in the free queue",
                     bid)
        else:
            num_held += 1
        if ref_cnt != len(held_by):
            culprit = held_by[0] if held_by else block.last_owner
            fail(ViolationKind.REFCOUNT_MISMATCH,
                 f"block {bid} has refcount {ref_cnt} but {len(held_by)} holders "
                 f"{held_by[:5]} (last taken by request {block.last_owner!r})", bid, culprit)
        if block_hash is None:
            if len(held_by) > 1:
                fail(ViolationKind.UNCACHED_SHARE,
                     f"block {bid} is shared by {held_by[:5]} but caches no content: only a "
                     "prefix hit may share a block", bid, held_by[-1])
        elif cached.get(block_hash) is not block:
            fail(ViolationKind.HASH_MAP_MISMATCH,
                 f"block {bid} carries hash {block_hash.hex()[:12]} that the map "
                 "does not give to it", bid)

    # 4. The hash map points only at blocks that carry that hash and its tokens; 8. a surviving
    # prefix is a contiguous head: no cached block outlives its parent.
    for key, block in cached.items():
        if block.block_hash != key or block.token_bytes is None:
            fail(ViolationKind.HASH_MAP_MISMATCH,
                 f"hash {key.hex()[:12]} maps to block {block.block_id} whose hash is "
                 f"{block.block_hash.hex()[:12] if block.block_hash else None}", block.block_id)
        elif block.cached_epoch != block.epoch and block.ref_cnt == 0:
            fail(ViolationKind.STALE_HASH,
                 f"free block {block.block_id} is hit-able under a hash set at epoch "
                 f"{block.cached_epoch}, but it was handed on since (epoch {block.epoch})",
                 block.block_id, block.last_owner)
        if block.parent_hash is not None and block.parent_hash not in cached:
            fail(ViolationKind.ORPHAN_BLOCK,
                 f"block {block.block_id} is cached but its parent {block.parent_hash.hex()[:12]} "
                 "was evicted: it can never be hit again", block.block_id, block.last_owner)

    # 4-6. Each held block describes what its holder wrote, under its holder's salt and epoch.
    bs = pool.block_size
    for record in ledger:
        rid = record.request_id
        num_full = record.num_computed_tokens // bs
        for idx, (block, epoch) in enumerate(
            zip(record.block_table, record.block_epochs, strict=True)
        ):
            bid = block.block_id
            if block.epoch != epoch:
                fail(ViolationKind.EPOCH_MISMATCH,
                     f"request {rid!r} saw block {bid} at epoch {epoch}, now {block.epoch}",
                     bid, rid)
            if block.block_hash is None:
                continue
            committed = idx < min(num_full, len(record.block_hashes))
            expected = record.block_hashes[idx] if committed else None
            if block.cached_epoch != block.epoch:
                fail(ViolationKind.STALE_HASH,
                     f"block {bid} keeps the hash it was cached under at epoch "
                     f"{block.cached_epoch} but was handed on (epoch {block.epoch})", bid, rid)
            elif expected != block.block_hash:
                fail(ViolationKind.STALE_HASH,
                     f"block {bid} (position {idx} of request {rid!r}) carries hash "
                     f"{block.block_hash.hex()[:12]} but holds "
                     f"{'uncommitted tokens' if expected is None else 'other content'}", bid, rid)
            elif block.salt != record.salt:
                fail(ViolationKind.CROSS_TENANT_SHARE,
                     f"block {bid} was computed under salt {block.salt!r} but request {rid!r} "
                     f"reads it under salt {record.salt!r}", bid, rid)
            elif block.adapter_digest != record.adapter_digest:
                fail(ViolationKind.CROSS_ADAPTER_SHARE,
                     f"block {bid} was computed under adapter {_digest(block.adapter_digest)} "
                     f"but request {rid!r} reads it under adapter "
                     f"{_digest(record.adapter_digest)}", bid, rid)

    # An in-progress announcement names a live request that really is computing that block.
    for block_hash, owner in (pending or {}).items():
        owner_record = ledger.get(owner)
        if owner_record is None or block_hash not in owner_record.pending_hashes:
            fail(ViolationKind.STALE_PENDING,
                 f"block hash {block_hash.hex()[:12]} is announced as being computed by request "
                 f"{owner!r}, which "
                 f"{'is gone' if owner_record is None else 'does not compute it'}", None, owner)

    # 7. Leaks: the engine's live set is the truth; any other holder is a leak.
    if live_request_ids is not None:
        live = set(live_request_ids)
        for record in ledger:
            if record.request_id not in live:
                fail(ViolationKind.LEAK,
                     f"request {record.request_id!r} is not live but holds "
                     f"{len(record.block_table)} blocks {record.block_ids[:8]}",
                     record.block_ids[0] if record.block_table else None, record.request_id)
        if not live and num_held:
            held = [b.block_id for b in pool.blocks if b.ref_cnt != 0]
            fail(ViolationKind.HELD_WHILE_IDLE,
                 f"no request is live but {num_held} blocks are held: {held[:8]}",
                 held[0])

    return AuditReport(
        num_blocks=pool.num_blocks,
        num_free_uncached=num_free_uncached,
        num_free_cached=num_free_cached,
        num_held=num_held,
        num_live_requests=len(ledger),
        violations=tuple(out),
    )


def _digest(digest: bytes | None) -> str:
    """An adapter digest as the audit names it (the base model: "none")."""
    return "none" if digest is None else digest.hex()[:16]
