"""/debug/kv: the cache's books for on-call: audit, census, who holds what, oldest requests."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvserve.kvcache import ImportState
from kvserve.runtime import LLMEngine

MAX_LISTED = 50


def kv_report(engine: LLMEngine) -> dict[str, Any]:
    """Runs on the engine thread: a full audit against the scheduler's live requests."""
    kv = engine.kv_cache
    live = engine.live_request_ids
    report = kv.audit(live_request_ids=live)
    stats = kv.stats()
    ledger = kv.ledger_summary()
    counters = asdict(stats.counters)
    counters["frees_by_reason"] = {k.value: v for k, v in stats.counters.frees_by_reason.items()}
    host_tier = None if stats.host is None else {
        "census": asdict(report.host) if report.host is not None else None,
        "usage": stats.host.usage,
        "counters": asdict(stats.host.counters),
    }
    disk_tier = None if stats.disk is None else {
        "census": asdict(report.disk) if report.disk is not None else None,
        "usage": stats.disk.usage,
        "counters": asdict(stats.disk.counters),
    }
    return {
        "audit": {
            "ok": report.ok,
            "violations": [{"kind": v.kind.value, "message": v.message, "block_id": v.block_id,
                            "request_id": v.request_id} for v in report.violations],
            "census": {"num_blocks": report.num_blocks, "held": report.num_held,
                       "free_cached": report.num_free_cached,
                       "free_uncached": report.num_free_uncached},
        },
        "usage": stats.usage,
        "counters": counters,
        "num_live_requests": len(live),
        "held_blocks_by_request": {e.request_id: e.num_blocks for e in ledger[:MAX_LISTED]},
        "oldest_requests": [
            {"request_id": e.request_id, "age_s": round(e.age_s, 3), "idle_s": round(e.idle_s, 3),
             "num_blocks": e.num_blocks, "num_tokens": e.num_tokens,
             "num_computed_tokens": e.num_computed_tokens}
            for e in ledger[:10]
        ],
        "block_size": stats.block_size,
        "host_tier": host_tier,
        "kv_imports": None if kv.imports is None else {
            "num_open": sum(1 for i in kv.imports.imports.values()
                            if i.state is ImportState.OPEN),
            "num_attached": sum(1 for i in kv.imports.imports.values()
                                if i.state is ImportState.ATTACHED),
            "num_pinned_slots": sum(kv.imports.pins().values()),
            "num_reserved_slots": len(kv.imports.reservations()),
            "num_cancelled": kv.imports.num_cancelled,
        },
        "disk_tier": disk_tier,
    }
