"""The engine over a device pool, a host tier and a disk tier, on the paged toy model: prefixes
copied back from the disk give the reference outputs; preemption by swapping resumes requests
without recomputing them, falls back to recompute when the host tier is full, and a failed
step or an abort leaves every tier clean."""

from __future__ import annotations

import pytest

from kvserve.engine import PreemptionMode, Request, SamplingParams, Scheduler, SchedulerConfig
from kvserve.kvcache import KVCacheManager
from tests.engine.conftest import make_rig
from tests.engine.test_scheduler import assert_clean
from tests.engine.toy_model import reference_generate

SWAP = PreemptionMode.SWAP
LONG = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    """`n` prompts of 10 tokens sharing no block (distinct first tokens)."""
    return [[10 + i, 3, 9, 1, 4, 4, 2, 8, 6, i % 7] for i in range(n)]


def test_prefixes_loaded_back_from_the_disk_match_the_reference():
    # Four distinct 3-block prefixes cycle through a 6-block pool and a 3-slot host tier: the
    # host evicts each prefix before it comes back, so it returns from the disk tier.
    rig = make_rig(num_blocks=6, num_host_slots=3, num_disk_slots=16)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    bases = [[40 + k, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] for k in range(4)]
    for n in range(12):
        prompt = bases[n % 4] + [n % 5]
        rig.core.add_request(Request(f"r{n}", prompt, greedy))
        rig.drain()
        assert rig.tokens[f"r{n}"] == reference_generate(prompt, 4), n
    stats = rig.kv.stats()
    assert stats.disk.counters.loads == stats.disk.counters.hit_blocks > 0
    assert stats.disk.counters.stores > 0 and stats.host.counters.evictions > 0
    assert_clean(rig)


def test_swap_preemption_resumes_without_recomputing():
    expected_computed = sum(len(p) + LONG.max_tokens - 1 for p in prompts(4))
    results = {}
    for mode in (PreemptionMode.RECOMPUTE, SWAP):  # recompute without a host tier to hit
        rig = make_rig(num_blocks=12, num_host_slots=24 if mode is SWAP else 0,
                       preemption_mode=mode)
        for i, prompt in enumerate(prompts(4)):
            rig.core.add_request(Request(f"r{i}", prompt, LONG))
        rig.drain()
        for i, prompt in enumerate(prompts(4)):
            assert rig.tokens[f"r{i}"] == reference_generate(prompt, 12), (mode, i)
        results[mode] = (rig.core.scheduler, rig.model.tokens_computed, rig.kv.stats())
        assert_clean(rig)
    recompute, swap = results[PreemptionMode.RECOMPUTE], results[SWAP]
    assert recompute[0].num_preemptions > 0 and recompute[1] > expected_computed
    assert swap[0].num_swap_preemptions == swap[0].num_preemptions > 0
    assert swap[1] == expected_computed  # every token's KV computed exactly once
    counters, host = swap[2].counters, swap[2].host
    assert counters.swapped_out_requests == counters.swapped_in_requests > 0
    assert counters.swap_fallbacks == 0
    assert host.counters.swapped_out_blocks == host.counters.swapped_in_blocks > 0
    assert host.num_swapped_slots == 0


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    rig = make_rig(num_blocks=12, num_host_slots=2, preemption_mode=SWAP)
    for i, prompt in enumerate(prompts(4)):
        rig.core.add_request(Request(f"r{i}", prompt, LONG))
    rig.drain()
    for i, prompt in enumerate(prompts(4)):
        assert rig.tokens[f"r{i}"] == reference_generate(prompt, 12), i
    counters = rig.kv.stats().counters
    assert counters.swap_fallbacks > 0 and counters.swapped_out_requests == 0
    assert rig.core.scheduler.num_preemptions > 0 == rig.core.scheduler.num_swap_preemptions
    assert_clean(rig)


def run_until_swapped(rig) -> str:
    for i, prompt in enumerate(prompts(4)):
        rig.core.add_request(Request(f"r{i}", prompt, LONG))
    for _ in range(200):
        rig.step()
        swapped = [r for r in rig.core.scheduler.waiting if rig.kv.is_swapped(r.request_id)]
        if swapped and not rig.kv.transfers.swap_stores:
            return swapped[0].request_id
    raise AssertionError("nothing was swapped out")


def test_abort_of_a_swapped_out_request_frees_its_host_slots():
    rig = make_rig(num_blocks=12, num_host_slots=24, preemption_mode=SWAP)
    victim = run_until_swapped(rig)
    host = rig.kv.transfers.host
    assert host.stats().num_swapped_slots > 0
    rig.core.abort([victim])
    assert not rig.kv.is_swapped(victim) and not rig.kv.has_request(victim)
    rig.drain()
    assert host.stats().num_swapped_slots == 0
    assert_clean(rig)


def test_a_failed_step_that_swapped_out_a_request_makes_it_recompute():
    rig = make_rig(num_blocks=12, num_host_slots=24, preemption_mode=SWAP)
    scheduler, run_step = rig.core.scheduler, rig.model.execute
    victims: list[str] = []

    def fail_the_first_swap_out(output):
        if not victims and rig.kv.transfers.swap_stores:  # scheduled, not yet copied
            victims.extend(r.request_id for r in scheduler.waiting
                           if rig.kv.is_swapped(r.request_id))
            raise RuntimeError("the device fell over")
        return run_step(output)

    rig.model.execute = fail_the_first_swap_out
    for i, prompt in enumerate(prompts(4)):
        rig.core.add_request(Request(f"r{i}", prompt, LONG))
    with pytest.raises(RuntimeError, match="fell over"):
        rig.drain()
    assert victims
    for request_id in victims:
        assert not rig.kv.is_swapped(request_id)
        assert scheduler.requests[request_id].num_computed_tokens == 0
    assert rig.kv.stats().counters.swap_fallbacks == len(victims)
    assert rig.kv.audit(scheduler.live_request_ids).ok
    rig.drain()
    for i, prompt in enumerate(prompts(4)):
        assert rig.tokens[f"r{i}"] == reference_generate(prompt, 12), i
    assert_clean(rig)


def test_swap_mode_needs_a_host_tier():
    with pytest.raises(ValueError, match="host tier"):
        Scheduler(SchedulerConfig(preemption_mode=SWAP), KVCacheManager(8, 4))
