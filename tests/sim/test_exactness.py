"""One worker, instantaneous compute: exactly the offline LRU replay's hit rate."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.bench.kvcache_replay import replay_trace
from kvserve.sim import Workload, load_workload
from tests.conftest import shared_file
from tests.sim.helpers import run, synthetic_trace, with_outputs


def assert_matches_replay(workload: Workload, capacity: int, block_size: int,
                          min_hit_rate: float = 0.05, **options: Any) -> None:
    # The engine refuses a prompt as long as the whole cache (it needs room for one more
    # token); the replay admits it. Equal lengths would be the one legitimate difference.
    assert all(r.input_length != capacity for r in workload.requests)
    replay = replay_trace(list(workload.requests), capacity, block_size)
    result = run(workload, capacity=capacity, block_size=block_size, **options)
    assert result.audit_ok
    assert result.num_rejected == replay.rejected
    assert result.hit_rate == replay.hit_rate  # exactly: same calls, same evictions
    assert replay.hit_rate > min_hit_rate, "the trace should exercise the cache"


@pytest.mark.parametrize(("capacity", "block_size"), [(200_000, 16), (20_000, 16), (9_000, 64)])
def test_synthetic_trace_matches_the_replay(capacity: int, block_size: int) -> None:
    assert_matches_replay(synthetic_trace(), capacity, block_size)


def test_chunked_prefill_and_a_small_batch_do_not_change_the_hit_rate() -> None:
    assert_matches_replay(synthetic_trace(), 20_000, 16, max_num_batched_tokens=512,
                          max_num_seqs=2)


def test_mooncake_slice_matches_the_replay() -> None:
    path = shared_file("traces/mooncake/conversation_trace.jsonl")
    workload = with_outputs(load_workload(str(path), limit=400), 1)
    assert_matches_replay(workload, 300_000, 16, min_hit_rate=0.02)


def test_decode_blocks_take_cache_space_the_replay_ignores() -> None:
    """With real answers the worker also caches their blocks (the replay models prompts only),
    so its hit rate can only be lower or equal; the gap is what the replay leaves out."""
    workload = synthetic_trace()
    replay = replay_trace(list(workload.requests), 20_000, 16)
    result = run(with_outputs(workload, 400), capacity=20_000)
    assert result.audit_ok
    assert result.hit_rate <= replay.hit_rate
