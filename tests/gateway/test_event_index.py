"""The index feed: vLLM events keyed by kvserve's own chain, removals by vLLM's hash, media."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.pipeline import PrecisePolicy, RouteRequest
from kvserve.gateway.core.prefix import engine_block_hashes
from kvserve.gateway.fleet.event_index import WorkerIndexFeed, first_block_salt
from kvserve.kvevents.wire import AllCleared, RemovedBlocks, StoredBlocks
from tests.gateway.helpers import views

BS = 4
PROMPT = list(range(100, 100 + 3 * BS))


def stored(hashes: tuple[int, ...], parent: int | None, tokens: list[int], medium: str = "GPU",
           salt: str | None = None) -> StoredBlocks:
    extra = None
    if salt is not None:
        extra = ((salt,),) + (None,) * (len(hashes) - 1)
    return StoredBlocks(hashes, parent, tuple(tokens), BS, medium, None, extra)


def matched(policy: PrecisePolicy, tokens: list[int], salt: str | None = None) -> int:
    key = engine_block_hashes(tokens, BS, salt, "tiny")
    decision = policy.route(RouteRequest(key, salt, len(tokens)), views({"w": 0, "v": 0}))
    return decision.predicted_hit_blocks if decision.worker_id == "w" else 0


def feed_and_policy() -> tuple[WorkerIndexFeed, PrecisePolicy]:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    return WorkerIndexFeed(policy, "w", "tiny"), policy


def test_blocks_are_keyed_by_kvserves_chain_across_events_and_parents() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((901,), None, PROMPT[:BS]), stored((902, 903), 901, PROMPT[BS:])])
    assert [feed.key_of(h) for h in (901, 902, 903)] == list(
        engine_block_hashes(PROMPT, BS, None, "tiny"))
    assert matched(policy, PROMPT) == 3
    assert matched(policy, PROMPT[:BS] + [0] * BS) == 1


def test_the_salt_in_the_first_blocks_extra_keys_keys_the_tenants_chain() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((7, 8), None, PROMPT[:2 * BS], salt="tenant-a")])
    assert matched(policy, PROMPT[:2 * BS], "tenant-a") == 2
    assert matched(policy, PROMPT[:2 * BS]) == 0  # unsalted: another chain
    assert matched(policy, PROMPT[:2 * BS], "tenant-b") == 0


def test_the_salt_follows_the_lora_name_in_extra_keys() -> None:
    assert first_block_salt(("ad", "s"), "ad") == "s"
    assert first_block_salt(("s",), None) == "s"
    assert first_block_salt((("mm", 0), "s", b"embeds"), None) == "s"
    assert first_block_salt(None, None) is None
    assert first_block_salt(("ad",), "ad") is None


def test_removal_by_vllm_hash_breaks_the_chain_where_it_was() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((1, 2, 3), None, PROMPT)])
    feed.apply([RemovedBlocks((3,), "GPU")])
    assert matched(policy, PROMPT) == 2
    feed.apply([RemovedBlocks((2,), None)])
    assert matched(policy, PROMPT) == 1
    feed.apply([RemovedBlocks((99,), None)])  # never stored: ignored
    assert matched(policy, PROMPT) == 1 and len(feed) == 1


def test_a_block_moved_to_cpu_still_counts_with_its_tier() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((1, 2), None, PROMPT[:2 * BS])])
    feed.apply([stored((2,), 1, PROMPT[BS:2 * BS], medium="CPU"), RemovedBlocks((2,), "GPU")])
    assert matched(policy, PROMPT[:2 * BS]) == 2
    assert feed.blocks_by_tier() == {"GPU": 1, "CPU": 1}
    feed.apply([RemovedBlocks((2,), "CPU")])
    assert matched(policy, PROMPT[:2 * BS]) == 1 and feed.blocks_by_tier() == {"GPU": 1}


def test_all_blocks_cleared_forgets_the_worker() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((1, 2), None, PROMPT[:2 * BS]), AllCleared()])
    assert matched(policy, PROMPT) == 0 and len(feed) == 0
    feed.apply([stored((1,), None, PROMPT[:BS])])  # the same hash again after the reset
    assert matched(policy, PROMPT) == 1


def test_a_block_whose_parent_was_never_seen_is_skipped_not_misplaced() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((5,), 4, PROMPT[BS:2 * BS])])
    assert feed.num_orphans == 1 and len(feed) == 0 and matched(policy, PROMPT) == 0


def test_data_parallel_ranks_hold_blocks_apart() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((1,), None, PROMPT[:BS])], rank=0)
    feed.apply([stored((1,), None, PROMPT[:BS])], rank=1)
    feed.apply([RemovedBlocks((1,), None)], rank=0)
    assert matched(policy, PROMPT) == 1  # rank 1 still holds it
    feed.apply([AllCleared()], rank=1)
    assert matched(policy, PROMPT) == 0


def test_a_stored_block_is_told_again_after_the_policy_forgot_the_worker() -> None:
    feed, policy = feed_and_policy()
    feed.apply([stored((1,), None, PROMPT[:BS])])
    policy.remove_worker("w")
    feed.apply([stored((1,), None, PROMPT[:BS])])
    assert matched(policy, PROMPT) == 1


def test_an_unsynced_worker_is_unknown_not_empty() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    for worker, base in (("w", 0), ("v", 1000)):
        WorkerIndexFeed(policy, worker, "tiny").apply(
            [stored((base + 1, base + 2), None, [base + t for t in PROMPT[:2 * BS]])])
    policy.set_synced("w", False)
    assert matched(policy, PROMPT) == 0  # its cached blocks count for nothing meanwhile
    policy.set_synced("w", True)
    assert matched(policy, PROMPT) == 2


def test_a_worker_whose_blocks_differ_from_the_gateways_is_named_once(
        caplog: pytest.LogCaptureFixture) -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, "w", "tiny", block_size=16)
    feed.apply([stored((1,), None, PROMPT[:BS]), stored((2,), 1, PROMPT[BS:2 * BS])])
    warnings = [r.message for r in caplog.records if "--block-size 4" in r.getMessage()]
    assert len(warnings) == 1
