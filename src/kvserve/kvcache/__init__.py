"""kvserve.kvcache — the paged KV cache with prefix caching, in pure Python.

Every block is accounted for: refcounts, epochs, a ledger of holders and an audit that proves the
books balance (DESIGN.md, "Invariants of the KV cache"). No torch, numpy, asyncio or HTTP.
"""

from kvserve.kvcache.audit import AuditReport, HostCensus, Violation, ViolationKind
from kvserve.kvcache.errors import CacheCorruption, UnknownRequest
from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvserve.kvcache.exports import cached_block_ids, prompt_record
from kvserve.kvcache.host_tier import HostTierCounters, HostTierStats
from kvserve.kvcache.imports import ImportPlan, ImportState, KVImports, SlotGrant
from kvserve.kvcache.ledger import LedgerEntry
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.stats import KVCacheCounters, KVCacheStats
from kvserve.kvcache.transfers import BlockLoad, BlockOffload, KVTransfers
from kvserve.kvcache.types import FreeReason, PrefixHit, SlotAllocation

__all__ = [
    "AllBlocksCleared",
    "AuditReport",
    "BlockLoad",
    "BlockOffload",
    "BlockRemoved",
    "BlockStored",
    "CacheCorruption",
    "FreeReason",
    "HostCensus",
    "HostTierCounters",
    "HostTierStats",
    "ImportPlan",
    "ImportState",
    "KVCacheCounters",
    "KVCacheManager",
    "KVCacheStats",
    "KVEvent",
    "KVImports",
    "KVTransfers",
    "LedgerEntry",
    "PrefixHit",
    "SlotAllocation",
    "SlotGrant",
    "UnknownRequest",
    "Violation",
    "ViolationKind",
    "cached_block_ids",
    "prompt_record",
]
