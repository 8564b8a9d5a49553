"""The end of a step's copies between the tiers: confirmed (loaded blocks published) or, when
the step failed, cancelled (nothing it copied readable, requests whose swap-out was lost freed).
Split out of the manager, whose public `complete_transfers` / `cancel_transfers` call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kvcache.publishing import publish, withdraw
from kvserve.kvcache.swapping import finish_swap_in
from kvserve.kvcache.transfers import KVTransfers, LoadSource
from kvserve.kvcache.types import FreeReason

if TYPE_CHECKING:
    from kvserve.kvcache.manager import KVCacheManager


def complete_step_copies(mgr: KVCacheManager, transfers: KVTransfers) -> None:
    """Stored slots become READY (or SWAPPED); each loaded block is published, or, for a swap-in,
    its request's table is restored."""
    tiers = mgr.transfers
    if tiers is None:
        assert not transfers, "transfers without a host tier"
        return
    for load in tiers.complete(transfers):
        record = mgr.ledger.get(load.request_id)
        assert record is not None, "a freed request's loads are cancelled at free"
        if load.source is LoadSource.SWAP:
            finish_swap_in(mgr.pool, tiers, record, load, mgr.enable_prefix_caching)
            continue
        withdraw(mgr.pending, record, [record.block_hashes[load.block_idx]])
        publish(mgr.pool, record, load.block_idx)


def cancel_step_copies(mgr: KVCacheManager, transfers: KVTransfers) -> set[str]:
    """Undo a failed step's copies; free the requests whose swap-out it carried (counted as
    fallbacks). Returns the requests whose loaded KV is missing (the caller ends them)."""
    tiers = mgr.transfers
    if tiers is None:
        return set()
    lost = tiers.swap_owners(transfers)
    failed = tiers.cancel(transfers)
    for request_id in lost:
        mgr.counters.swap_fallbacks += 1
        mgr.free(request_id, FreeReason.PREEMPTED)
    return failed
