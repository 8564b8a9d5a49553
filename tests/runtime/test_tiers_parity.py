"""The disk tier and swap preemption through the whole engine, on the tiny random checkpoints:
prefixes that come back from the disk tier, and requests swapped out of a forced small pool and
back, give exactly the greedy tokens of a pool that never evicts or preempts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.engine import SamplingParams
from kvserve.runtime import EngineArgs
from tests.runtime.conftest import (
    PARITY_ARCHS,
    assert_no_blocks_held,
    make_engine,
    random_prompt,
    run_to_completion,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
BLOCK_BYTES = 2048  # one 4-token block of the tiny checkpoints (2 layers, 2 KV heads of 16, fp32)
SMALL_POOL = 12
HOST_BYTES = 10 * BLOCK_BYTES


@pytest.fixture(params=PARITY_ARCHS)
def arch(request) -> str:
    return request.param


def prefix_workload() -> list[tuple[str, list[int]]]:
    """Four 24-token prefixes in turn, each time with a new suffix: with a 12-block pool and a
    10-slot host tier (one step's evictions fit, three prefixes of 6 blocks do not), every
    prefix has left both by the time it comes back."""
    prefixes = [random_prompt(24, seed=70 + i) for i in range(4)]
    return [(f"q{n}", prefixes[n % 4] + random_prompt(5, seed=90 + n)) for n in range(12)]


def run_one_by_one(engine) -> tuple[dict[str, list[int]], int]:
    tokens, computed = {}, 0
    for rid, prompt in prefix_workload():
        engine.add_request(rid, prompt, GREEDY)
        out = run_to_completion(engine)[rid]
        tokens[rid] = out.outputs[0].token_ids
        computed += len(prompt) - out.num_cached_tokens
    return tokens, computed


def test_disk_tier_hits_give_the_tokens_of_a_pool_that_never_evicts(arch, checkpoints,
                                                                    tmp_path: Path):
    path = checkpoints[arch]
    expected, computed_big = run_one_by_one(make_engine(path))
    host_only = make_engine(path, num_kv_blocks=SMALL_POOL, kv_host_tier_bytes=HOST_BYTES)
    without_disk, computed_host_only = run_one_by_one(host_only)
    tiered = make_engine(path, num_kv_blocks=SMALL_POOL, kv_host_tier_bytes=HOST_BYTES,
                         kv_disk_tier_bytes=64 * BLOCK_BYTES, kv_disk_tier_path=str(tmp_path))
    with_disk, computed_with = run_one_by_one(tiered)

    assert with_disk == expected and without_disk == expected
    disk = tiered.kv_cache.stats().disk
    assert disk.num_slots == 64
    assert disk.counters.stores > 0 and disk.counters.loads == disk.counters.hit_blocks > 0
    assert computed_with == computed_big < computed_host_only  # the disk kept what host lost
    assert list(tmp_path.iterdir()) == []  # the tier's file was unlinked once mapped
    assert_no_blocks_held(tiered)
    report = tiered.kv_cache.check_idle()
    assert report.disk is not None and report.disk.num_storing == report.disk.num_pinned == 0


def swap_workload() -> list[tuple[str, list[int]]]:
    return [(f"s{i}", random_prompt(9 + i, seed=120 + i)) for i in range(4)]


def run_all_at_once(engine) -> dict[str, list[int]]:
    for rid, prompt in swap_workload():
        engine.add_request(rid, prompt, LONG)
    done = run_to_completion(engine)
    return {rid: done[rid].outputs[0].token_ids for rid, _ in swap_workload()}


def test_swap_preemption_gives_the_tokens_of_recompute_and_of_a_big_pool(arch, checkpoints):
    """Four requests of 9-12 prompt tokens decode 24 tokens each in a 12-block pool (48
    tokens): the newest are preempted again and again, swapped out with their partial last
    blocks and decode-written blocks, and resumed without recomputing anything."""
    path = checkpoints[arch]
    expected = run_all_at_once(make_engine(path))
    recompute = make_engine(path, num_kv_blocks=SMALL_POOL)
    swap = make_engine(path, num_kv_blocks=SMALL_POOL, kv_host_tier_bytes=64 * BLOCK_BYTES,
                       preemption_mode="swap")
    assert run_all_at_once(recompute) == expected
    assert run_all_at_once(swap) == expected

    every_token_once = sum(len(p) + LONG.max_tokens - 1 for _, p in swap_workload())
    scheduler, counters = swap.core.scheduler, swap.kv_cache.stats().counters
    assert scheduler.num_swap_preemptions == scheduler.num_preemptions > 0
    assert counters.swapped_out_requests == counters.swapped_in_requests > 0
    assert counters.swap_fallbacks == 0
    assert scheduler.num_scheduled_tokens == every_token_once  # nothing recomputed
    assert recompute.core.scheduler.num_preemptions > 0
    assert recompute.core.scheduler.num_scheduled_tokens > every_token_once
    assert swap.kv_cache.stats().host.num_swapped_slots == 0
    assert_no_blocks_held(swap)


def test_disk_tier_and_swap_settings_are_checked_at_the_boundary(tmp_path: Path):
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineArgs(kv_disk_tier_bytes=1 << 20, kv_disk_tier_path=str(tmp_path))
    with pytest.raises(ValueError, match="give both or neither"):
        EngineArgs(kv_host_tier_bytes=1 << 20, kv_disk_tier_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_disk_tier_bytes must be >= 0"):
        EngineArgs(kv_disk_tier_bytes=-1)
    with pytest.raises(ValueError, match="'recompute' or 'swap'"):
        EngineArgs(preemption_mode="evict")
    with pytest.raises(ValueError, match=r"swap preemption .* needs one"):
        EngineArgs(preemption_mode="swap")
    assert EngineArgs(kv_host_tier_bytes=1, kv_disk_tier_bytes=5000,
                      kv_disk_tier_path=str(tmp_path)).resolve_num_disk_slots(2048) == 2
