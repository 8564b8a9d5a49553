"""Shared helpers for the cache tests: a manager with a fake clock, and whole-request steps."""

from __future__ import annotations

import pytest

from kvserve.kvcache import KVCacheManager

# Helper modules that assert: let pytest show the operands of a failed assert.
pytest.register_assert_rewrite("tests.kvcache.stateful_model", "tests.kvcache.planted_harness")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admit(manager: KVCacheManager, request_id: str, tokens: list[int], salt: str | None = None):
    """Add, look up, allocate the whole prompt and commit it (a one-step prefill)."""
    manager.add_request(request_id, tokens, cache_salt=salt)
    hit = manager.lookup(request_id)
    allocation = manager.allocate_slots(request_id, len(tokens) - hit.num_tokens, hit)
    assert allocation is not None, f"no room for {request_id}"
    manager.commit(request_id, len(tokens))
    return hit, allocation


def state_of(manager: KVCacheManager) -> tuple:
    """Everything allocation must leave untouched when it says no."""
    pool = manager.pool
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.epoch for b in pool.blocks],
        pool.free_queue.block_ids(),
        sorted(pool.cached),
        manager.stats(),
        {r.request_id: list(r.block_ids) for r in manager.ledger},
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
