"""The idle check from the books the cache already keeps, in O(live requests) instead of
O(num_blocks).

When the engine drains, no request is live, so the cache must hold nothing (DESIGN invariant
7): every block free, the ledger empty, no block announced as in progress, no copy between the
tiers unconfirmed, no host slot pinned. The pool, the ledger and the host tier count all of
that as they work, so the check reads counts. A leaked block always shows in them: a free that
never reached the pool leaves the free count short of capacity; a free that never reached the
ledger leaves its record behind. What counts cannot see (a free queue whose links disagree
with its count, a refcount that disagrees with the tables) is the full audit's job; the engine
still runs it on drain, rate-limited (SchedulerConfig.idle_audit_interval_s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kvserve.kvcache.audit import AuditReport, Violation, ViolationKind
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.imports import ImportState, KVImports
from kvserve.kvcache.ledger import Ledger
from kvserve.kvcache.transfers import TransferLedger


def quick_idle_report(pool: BlockPool, ledger: Ledger, pending: Mapping[bytes, str],
                      transfers: TransferLedger | None,
                      imports: KVImports | None = None) -> AuditReport:
    """What the counts say about an idle cache (no request live). Never mutates. The census
    comes from the same counts; a finding names the request when it can, never a block (the
    full audit does: `merge_reports`)."""
    out: list[Violation] = []
    for record in ledger:  # every holder is a leak: nobody is live
        out.append(Violation(
            ViolationKind.LEAK, f"request {record.request_id!r} is not live but is still in the "
            f"ledger with {len(record.block_table)} blocks", None, record.request_id))
    num_free, num_cached_free = pool.num_free_blocks, pool.num_cached_free
    if num_free != pool.num_blocks:
        out.append(Violation(ViolationKind.HELD_WHILE_IDLE,
                             f"no request is live but the pool counts "
                             f"{pool.num_blocks - num_free} of {pool.num_blocks} blocks held"))
    elif num_cached_free != len(pool.cached):  # with nothing held, every cached block is free
        out.append(Violation(ViolationKind.FREE_QUEUE_BROKEN,
                             f"the pool counts {num_cached_free} free cached blocks, but its map "
                             f"caches {len(pool.cached)} (all are free when idle)"))
    for block_hash, owner in pending.items():
        out.append(Violation(ViolationKind.STALE_PENDING,
                             f"block hash {block_hash.hex()[:12]} is announced as being computed "
                             f"by request {owner!r}, but no request is live", None, owner))
    if transfers is not None:
        out += _quick_tier_findings(transfers, imports)
    return AuditReport(
        num_blocks=pool.num_blocks,
        num_free_uncached=num_free - num_cached_free,
        num_free_cached=num_cached_free,
        num_held=pool.num_blocks - num_free,
        num_live_requests=len(ledger),
        violations=tuple(out),
    )


def _quick_tier_findings(transfers: TransferLedger,
                         imports: KVImports | None) -> list[Violation]:
    """The host and disk tiers when idle: no copy unconfirmed, no swap slot held, and no slot
    storing or pinned except by an import whose transfer is still open (it owns them)."""
    out: list[Violation] = []
    host, disk = transfers.host, transfers.disk
    open_imports = [imp for imp in (imports.imports.values() if imports is not None else ())
                    if imp.state is ImportState.OPEN]
    open_reserved = sum(len(imp.reserved) for imp in open_imports)
    open_pins = sum(len(imp.pinned) for imp in open_imports)
    disk_storing = len(disk.storing) if disk is not None else 0
    if not transfers.is_idle or len(host.storing) != open_reserved or disk_storing:
        out.append(Violation(ViolationKind.HOST_TIER_BROKEN,
                             f"no request is live but {len(transfers.stores)} stores and "
                             f"{len(transfers.loads)} loads are unconfirmed "
                             f"({len(host.storing)} host slots storing, {open_reserved} of them "
                             f"for open imports; {disk_storing} disk slots storing)"))
    disk_pins = disk.num_pins if disk is not None else 0
    if host.num_pins != open_pins or disk_pins:
        out.append(Violation(ViolationKind.HOST_PIN_MISMATCH,
                             f"no load is in flight but host slots carry {host.num_pins} pins "
                             f"({open_pins} by open imports) and disk slots {disk_pins}"))
    if host.private:
        out.append(Violation(ViolationKind.LEAK,
                             f"no request is live but {len(host.private)} host slots are held "
                             "for swapped-out requests"))
    attached = [i for i, imp in (imports.imports.items() if imports is not None else ())
                if imp.state is ImportState.ATTACHED]
    if attached:
        out.append(Violation(ViolationKind.IMPORT_LEAK,
                             f"no request is live but {len(attached)} imports are attached to "
                             f"requests (first: {attached[0]!r})", None, attached[0]))
    return out


def merge_reports(full: AuditReport, quick: AuditReport) -> AuditReport:
    """The full audit's report (its census, its named culprits), plus the quick check's
    findings of kinds the full audit did not report (a count only the quick check reads)."""
    seen = full.kinds()
    extra = tuple(v for v in quick.violations if v.kind not in seen)
    return replace(full, violations=full.violations + extra) if extra else full
