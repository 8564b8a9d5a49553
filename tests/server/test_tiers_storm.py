"""A disconnect storm over a device pool, a host tier, a disk tier and swap preemption: a real
`kvserve serve` with every tier in play and half its clients gone mid-stream is left with every
tier clean."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.server.conftest import StartServer
from tests.server.test_disconnect_storm import (
    HOST_TIER_REQUESTS,
    _host_tier_storm,
    assert_idle_and_audited,
)


def test_a_disconnect_storm_over_disk_and_swap_leaves_every_tier_clean(
        start_server: StartServer, tmp_path: Path) -> None:
    """Requests preempt each other in a small pool (swapped to the host tier and back), the
    host tier is too small for the tenants' prefixes (they go on to the disk tier and come
    back), and half the clients drop after 1-3 chunks, often while copies are in flight or
    while they are swapped out. Afterwards nothing is held, storing, pinned or swapped in any
    tier, the audit (all tiers) is clean, and the disk file was never left in the directory."""
    server = start_server(["--block-size", "4", "--num-kv-blocks", "96",
                           "--kv-host-tier-bytes", str(1 << 17),
                           "--kv-disk-tier-bytes", str(1 << 20),
                           "--kv-disk-tier-path", str(tmp_path),
                           "--preemption-mode", "swap", "--max-num-seqs", "16"])
    outcomes = asyncio.run(_host_tier_storm(server.url))
    assert outcomes.count("dropped") == HOST_TIER_REQUESTS // 2
    assert_idle_and_audited(server)
    m = server.metrics()
    assert m.value("kvserve:kv_swap_outs_total") > 0
    assert m.value("kvserve:kv_swap_ins_total") > 0
    assert m.value("kvserve:kv_disk_stores_total") > 0
    assert m.value("kvserve:kv_disk_loads_total") > 0
    for tier in ("host", "disk"):
        for gauge in ("storing", "pinned", "swapped"):
            assert m.value(f"kvserve:kv_{tier}_{gauge}_slots") == 0, (tier, gauge)
    report = server.debug_kv()
    for tier in ("host_tier", "disk_tier"):
        census = report[tier]["census"]
        assert census["num_storing"] == census["num_pinned"] == census["num_swapped"] == 0
    assert list(tmp_path.iterdir()) == []
