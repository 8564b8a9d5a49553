"""The host KV tier through the whole engine: prefixes evicted from a small device pool and
copied back from host memory give exactly the greedy tokens of a pool that never evicts, and of
the same small pool without the tier, while computing fewer prompt tokens."""

from __future__ import annotations

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
HOST_BYTES = 1 << 17  # 64 blocks of the tiny checkpoints (2 layers, 2 KV heads of 16, fp32)
SMALL_POOL = 12  # blocks of 4 tokens: one 37-token sequence fits, its predecessor's prefix not


def workload(repeat: bool = False) -> list[tuple[str, list[int]]]:
    """Two 24-token prefixes, alternating, each time with a new suffix (or, with `repeat`, the
    same two whole prompts): every request's prefix was evicted from the small pool by the
    request before it."""
    prefixes = [random_prompt(24, seed=40 + i) for i in range(2)]
    return [(f"q{n}", prefixes[n % 2] + random_prompt(5, seed=60 + (n % 2 if repeat else n)))
            for n in range(6)]


def run_one_by_one(engine, repeat: bool = False) -> tuple[dict[str, list[int]], int]:
    """Each request runs alone to completion, in order. Returns the tokens and the number of
    prompt tokens the engine computed (not served from any cache tier)."""
    tokens, computed = {}, 0
    for rid, prompt in workload(repeat):
        engine.add_request(rid, prompt, GREEDY)
        out = run_to_completion(engine)[rid]
        tokens[rid] = out.outputs[0].token_ids
        computed += len(prompt) - out.num_cached_tokens
    return tokens, computed


def run_all_at_once(engine) -> dict[str, list[int]]:
    for rid, prompt in workload():
        engine.add_request(rid, prompt, GREEDY)
    done = run_to_completion(engine)
    return {rid: done[rid].outputs[0].token_ids for rid, _ in workload()}


def assert_host_tier_idle(engine) -> None:
    assert_no_blocks_held(engine)
    report = engine.kv_cache.check_idle()
    assert report.host is not None and report.host.num_storing == report.host.num_pinned == 0


@pytest.fixture(params=PARITY_ARCHS)
def arch(request) -> str:
    return request.param


def test_host_tier_hits_give_the_tokens_of_a_pool_that_never_evicts(arch, checkpoints):
    path = checkpoints[arch]
    expected, computed_big = run_one_by_one(make_engine(path))
    no_tier = make_engine(path, num_kv_blocks=SMALL_POOL)
    without, computed_without = run_one_by_one(no_tier)
    tiered = make_engine(path, num_kv_blocks=SMALL_POOL, kv_host_tier_bytes=HOST_BYTES)
    with_tier, computed_with = run_one_by_one(tiered)

    assert with_tier == expected and without == expected
    host = tiered.kv_cache.stats().host
    assert host.num_slots >= 16
    assert host.counters.stores > 0 and host.counters.loads > 0
    assert host.counters.hit_tokens == computed_without - computed_with > 0
    assert computed_with == computed_big  # everything the big pool kept, the host tier kept
    assert no_tier.kv_cache.stats().counters.evicted_blocks > 0
    assert_no_blocks_held(no_tier)
    assert_host_tier_idle(tiered)


def test_a_block_offloaded_and_loaded_into_in_one_step_keeps_its_old_kv(arch, checkpoints):
    """The tightest pool: a host hit's loads go into blocks evicted (offloaded) in the same
    step, and the next request hits what was offloaded; offloads must read before loads write."""
    path = checkpoints[arch]
    expected, _ = run_one_by_one(make_engine(path), repeat=True)
    tiered = make_engine(path, num_kv_blocks=10, kv_host_tier_bytes=HOST_BYTES)
    with_tier, computed = run_one_by_one(tiered, repeat=True)
    assert with_tier == expected
    assert tiered.kv_cache.stats().host.counters.hit_tokens == 4 * 24  # 1 block stays on device
    assert computed == 2 * 29 + 4 * 1
    assert_host_tier_idle(tiered)


def test_host_tier_with_all_requests_queued_at_once_gives_the_same_tokens(arch, checkpoints):
    """Admissions wait for room and for each other's prefixes; evictions, stores and loads
    interleave with running decodes in the same steps."""
    path = checkpoints[arch]
    expected = run_all_at_once(make_engine(path))
    tiered = make_engine(path, num_kv_blocks=SMALL_POOL, kv_host_tier_bytes=HOST_BYTES,
                         max_num_batched_tokens=16)
    assert run_all_at_once(tiered) == expected
    assert tiered.kv_cache.stats().host.counters.loads > 0
    assert_host_tier_idle(tiered)


def test_host_tier_size_is_checked_at_the_boundary():
    with pytest.raises(ValueError, match="kv_host_tier_bytes must be >= 0"):
        EngineArgs(kv_host_tier_bytes=-1)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineArgs(kv_host_tier_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no block of 2048 bytes"):
        EngineArgs(kv_host_tier_bytes=100).resolve_num_host_slots(2048)
    assert EngineArgs().resolve_num_host_slots(2048) == 0
    assert EngineArgs(kv_host_tier_bytes=5000).resolve_num_host_slots(2048) == 2
