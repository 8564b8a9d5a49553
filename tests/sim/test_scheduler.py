"""The engine's scheduling rules, pinned on exact states of a tiny cache."""

from __future__ import annotations

from kvserve.kvcache import KVCacheManager
from kvserve.sim.scheduler import SchedulerLimits, SimScheduler
from kvserve.sim.seq import OUTPUT_TOKEN_ID, SimSeq


def seq(name: str, first_token: int, length: int = 12) -> SimSeq:
    return SimSeq(name, list(range(first_token, first_token + length)), 8, None)


def finish_step(sched: SimScheduler, items: list[tuple[SimSeq, int, int]]) -> None:
    """What the worker does at a step's end: commit, then append each sampled token."""
    for s, start, num_new in items:
        s.num_computed = start + num_new
        sched.kv.commit(s.seq_id, s.num_computed)
        if s.num_computed == s.num_tokens:
            s.num_output += 1
            sched.kv.append_token_ids(s.seq_id, [OUTPUT_TOKEN_ID])
            s.num_tokens += 1


def test_the_newest_runner_is_preempted_and_waits_at_the_head() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    sched = SimScheduler(SchedulerLimits(64, 8), kv, 40)
    a, b, c = seq("a", 0), seq("b", 100), seq("c", 200)
    sched.waiting.extend([a, b, c])
    items, plain = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("a", 0, 12), ("b", 0, 12),
                                                                ("c", 0, 12)]
    assert not plain and kv.pool.num_free_blocks == 1
    finish_step(sched, items)
    # Each now needs a 4th block: a takes the last free one, b cannot: c (newest) goes.
    items, plain = sched.schedule()
    assert [s.seq_id for s, _, _ in items] == ["a", "b"]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert c.num_computed == 0 and c.num_preemptions == 1 and sched.num_preemptions == 1
    assert not plain  # a step with a preemption is never fast-forwarded
    assert not kv.has_request("c")


def test_waiting_is_first_come_first_served_and_capped_by_max_num_seqs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = SimScheduler(SchedulerLimits(64, 8), kv, 32)
    big, small = seq("big", 0, 28), seq("small", 100, 4)
    blocker = seq("blocker", 200, 8)
    sched.waiting.extend([blocker, big, small])
    items, _ = sched.schedule()
    # blocker takes 2 blocks; big needs 7 of the 6 left: it waits, and small may not overtake.
    assert [s.seq_id for s, _, _ in items] == ["blocker"]
    assert list(sched.waiting) == [big, small]
    sched2 = SimScheduler(SchedulerLimits(64, 1), KVCacheManager(8, 4), 32)
    sched2.waiting.extend([seq("x", 0, 4), seq("y", 50, 4)])
    items, _ = sched2.schedule()
    assert [s.seq_id for s, _, _ in items] == ["x"]


def test_chunked_prefill_shares_one_token_budget_running_first() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = SimScheduler(SchedulerLimits(10, 8), kv, 256)
    long, late = seq("long", 0, 25), seq("late", 100, 6)
    sched.waiting.append(long)
    items, _ = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("long", 0, 10)]
    finish_step(sched, items)
    sched.waiting.append(late)
    items, _ = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("long", 10, 10)]
    finish_step(sched, items)
    items, _ = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("long", 20, 5), ("late", 0, 5)]


def test_a_decode_run_stops_where_a_seq_finishes_or_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = SimScheduler(SchedulerLimits(64, 8), kv, 24)
    a, b = seq("a", 0, 4), seq("b", 100, 4)
    a.max_tokens, b.max_tokens = 50, 3
    sched.waiting.extend([a, b])
    finish_step(sched, sched.schedule()[0])
    items, plain = sched.schedule()
    assert plain
    assert sched.decode_run_length(items) == 2  # b samples its 3rd and last token in step 2
    b.max_tokens = 50
    # 4 free blocks; each seq needs one more block every 4 steps after its first.
    assert sched.decode_run_length(items) == 8


def test_a_request_whose_prefix_is_being_computed_waits_and_hits_it() -> None:
    """The engine's rule: a twin arriving during a chunked prefill is not admitted to compute
    the same blocks again; a later, unrelated request may go first; the twin then hits."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = SimScheduler(SchedulerLimits(8, 8), kv, 256)
    first = SimSeq("first", list(range(20)), 4, None)
    sched.waiting.append(first)
    items, _ = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("first", 0, 8)]
    finish_step(sched, items)
    twin = SimSeq("twin", [*range(20), 999], 4, None)  # the same 20 tokens, then its own
    other = SimSeq("other", list(range(500, 503)), 4, None)
    sched.waiting.extend([twin, other])
    items, _ = sched.schedule()
    # first computes tokens 8..15 (its blocks 2-3 are announced); twin would compute 8.. too
    assert [(s.seq_id, start, n) for s, start, n in items] == [("first", 8, 8)]
    finish_step(sched, items)
    items, _ = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in items] == [("first", 16, 4),
                                                                ("other", 0, 3)]
    assert list(sched.waiting) == [twin]  # skipped, and kept at the head
    finish_step(sched, items)
    items, _ = sched.schedule()
    twin_items = [(start, n) for s, start, n in items if s is twin]
    assert twin_items == [(20, 1)]  # all 20 shared tokens (5 blocks) hit; only its own computed
    assert twin.num_cached == 20
