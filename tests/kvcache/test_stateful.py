"""Random interleavings of everything an engine does to the cache, checked after every step.

A hypothesis state machine plays the engine: it adds requests (a few shared prefixes, random
suffixes, three tenants), admits them with their prefix hit (sometimes a hit stashed earlier in
the step), prefills in chunks, decodes, aborts / preempts / finishes (sometimes twice), forgets
some requests (leaks), advances a fake clock and reaps, all under memory pressure. Its own model
of the engine's live set and of what each tenant has written is checked against the cache after
every step: the audit, `verify`, the block census, the KV-event index and the hit rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FreeReason,
    KVCacheManager,
    PrefixHit,
    ViolationKind,
)

TENANTS = (None, "tenant-a", "tenant-b")
PREFIXES = (
    (1, 2, 3, 4, 5, 6, 7, 8),  # a system prompt
    (1, 2, 3, 4, 9, 9),  # shares its first half
    (20, 21, 22, 23, 24),
)
ENGINE_REASONS = tuple(r for r in FreeReason if r is not FreeReason.REAPED)
IDLE_TIMEOUT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(manager: KVCacheManager) -> dict[str, object]:
    """What a refused allocation, a lookup or a redundant free must leave as it was. The
    `redundant_frees` counter is left out: it counts the redundant free."""
    pool = manager.pool
    stats = manager.stats()
    counters = replace(stats.counters, redundant_frees=0)
    return {
        "refcounts": [b.ref_cnt for b in pool.blocks],
        "epochs": [b.epoch for b in pool.blocks],
        "hashes": [b.block_hash for b in pool.blocks],
        "free_queue": pool.free_queue.block_ids(),
        "hash_map": {key: b.block_id for key, b in pool.cached.items()},
        "stats": replace(stats, counters=counters),
        "ledger": {
            r.request_id: (tuple(r.block_ids), r.num_computed_tokens, r.last_active)
            for r in manager.ledger
        },
    }


def assert_unchanged(before: dict[str, object], after: dict[str, object], what: str) -> None:
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    assert not changed, f"{what} changed state: {changed}"


@dataclass
class Req:
    """The engine's view of one request."""

    tokens: list[int]
    salt: str | None
    last_active: float
    admitted: bool = False
    computed: int = 0  # tokens whose KV is written (committed)
    scheduled: int = 0  # tokens with slots


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None

    @initialize(num_blocks=st.integers(12, 40), block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.clock = FakeClock()
        self.mgr = KVCacheManager(num_blocks, block_size, clock=self.clock, enable_events=True)
        self.num_blocks, self.bs = num_blocks, block_size
        self.live: dict[str, Req] = {}
        self.abandoned: dict[str, Req] = {}  # the engine forgot them; the cache still holds them
        self.stash: dict[str, PrefixHit] = {}  # hits looked up earlier in the step
        # (salt, block-aligned token prefix) whose KV a request of that salt wrote and committed.
        self.written: set[tuple[str | None, tuple[int, ...]]] = set()
        self.index: set[bytes] = set()  # the cache as an external indexer sees it from KV events
        self.num_removed = 0  # hashes in BlockRemoved events
        self.next_id = 0

    # -- helpers --------------------------------------------------------------------------

    @property
    def manager(self) -> KVCacheManager:
        assert self.mgr is not None
        return self.mgr

    def _pick(self, data: st.DataObject, rids: list[str]) -> str:
        return data.draw(st.sampled_from(sorted(rids)), label="request")

    def _waiting(self) -> list[str]:
        return [rid for rid, r in self.live.items() if not r.admitted]

    def _stashed(self) -> list[str]:
        return [rid for rid in self._waiting() if rid in self.stash]

    def _touch(self, req: Req) -> None:
        req.last_active = self.clock.now

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def _commit(self, rid: str, upto: int) -> None:
        req = self.live[rid]
        self.manager.commit(rid, upto)
        req.computed = upto
        self._touch(req)
        for k in range(1, upto // self.bs + 1):
            self.written.add((req.salt, tuple(req.tokens[: k * self.bs])))

    def _allocate(self, rid: str, num_new: int, hit: PrefixHit | None = None) -> bool:
        """allocate_slots; a refusal must change nothing, statistics included."""
        mgr = self.manager
        before, counters = snapshot(mgr), mgr.stats().counters
        out = mgr.allocate_slots(rid, num_new, hit)
        if out is None:
            event("allocation refused")
            assert_unchanged(before, snapshot(mgr), f"refused allocate_slots({rid!r}, {num_new})")
            return False
        req = self.live[rid]
        if hit is not None:
            assert out.num_cached_tokens == hit.num_tokens
            after = mgr.stats().counters
            assert after.prefix_queries_tokens == counters.prefix_queries_tokens + len(req.tokens)
            assert after.prefix_hits_tokens == counters.prefix_hits_tokens + hit.num_tokens
            assert mgr.block_table(rid)[: len(hit.block_ids)] == list(hit.block_ids)
            req.admitted, req.computed = True, hit.num_tokens
        req.scheduled = max(req.scheduled, req.computed + num_new)
        self._touch(req)
        assert len(mgr.block_table(rid)) == self._num_blocks_for(req.scheduled)
        return True

    def _check_hit(self, rid: str, hit: PrefixHit) -> None:
        req, pool = self.live[rid], self.manager.pool
        num = len(hit.block_ids)
        assert hit.num_tokens == num * self.bs and len(hit.epochs) == num
        assert hit.num_tokens < len(req.tokens), "the hit must leave a prompt token to compute"
        assert list(hit.epochs) == [pool.blocks[b].epoch for b in hit.block_ids]
        for k in range(1, num + 1):
            key = (req.salt, tuple(req.tokens[: k * self.bs]))
            assert key in self.written, (
                f"{rid} (salt {req.salt!r}) got a hit on block {hit.block_ids[k - 1]} whose "
                "content no request of its tenant ever wrote"
            )
        assert all(pool.blocks[b].salt == req.salt for b in hit.block_ids)
        if num:
            event("prefix hit")
        elif any(
            (salt, tuple(req.tokens[: self.bs])) in self.written
            for salt in TENANTS
            if salt != req.salt
        ):
            event("cross-tenant attempt: no hit")

    def _admit_with(self, data: st.DataObject, rid: str, hit: PrefixHit) -> None:
        req = self.live[rid]
        num_new = data.draw(st.integers(1, len(req.tokens) - hit.num_tokens), label="chunk")
        if self._allocate(rid, num_new, hit):
            upto = data.draw(st.integers(req.computed, req.scheduled), label="commit to")
            self._commit(rid, upto)

    # -- rules ------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        salt=st.sampled_from(TENANTS),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=14),
        admit_now=st.booleans(),
    )
    def add_request(
        self,
        data: st.DataObject,
        salt: str | None,
        prefix: tuple[int, ...],
        suffix: list[int],
        admit_now: bool,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        tokens = [*prefix, *suffix]
        self.manager.add_request(rid, tokens, cache_salt=salt)
        self.live[rid] = Req(tokens, salt, self.clock.now)
        if admit_now:
            self._admit(data, rid)

    @rule(
        data=st.data(),
        arrivals=st.lists(
            st.tuples(
                st.sampled_from(TENANTS),
                st.sampled_from(PREFIXES),
                st.lists(st.integers(0, 3), min_size=2, max_size=14),
            ),
            min_size=2,
            max_size=6,
        ),
    )
    def burst(
        self,
        data: st.DataObject,
        arrivals: list[tuple[str | None, tuple[int, ...], list[int]]],
    ) -> None:
        """A load spike: several requests arrive and are admitted at once (memory pressure)."""
        for salt, prefix, suffix in arrivals:
            self.add_request(data, salt, prefix, suffix, admit_now=True)

    @precondition(lambda self: self._waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        self._admit(data, self._pick(data, self._waiting()))

    def _admit(self, data: st.DataObject, rid: str) -> None:
        before = snapshot(self.manager)
        hit = self.manager.lookup(rid)
        assert_unchanged(before, snapshot(self.manager), "lookup")
        self._check_hit(rid, hit)
        self._admit_with(data, rid, hit)

    @precondition(lambda self: self._waiting())
    @rule()
    def stash_lookups(self) -> None:
        """The engine looks the whole waiting queue up now and allocates later in the step."""
        for rid in self._waiting():
            self.stash[rid] = hit = self.manager.lookup(rid)
            self._check_hit(rid, hit)

    @precondition(lambda self: self._stashed())
    @rule(data=st.data())
    def admit_with_stashed_hit(self, data: st.DataObject) -> None:
        rid = self._pick(data, self._stashed())
        hit = self.stash.pop(rid)
        pool = self.manager.pool
        if [pool.blocks[b].epoch for b in hit.block_ids] != list(hit.epochs):
            before = snapshot(self.manager)
            with pytest.raises(ValueError, match="stale prefix hit"):
                self.manager.allocate_slots(rid, len(self.live[rid].tokens) - hit.num_tokens, hit)
            assert_unchanged(before, snapshot(self.manager), "a refused stale hit")
            event("stale stashed hit refused")
            self._admit(data, rid)  # the engine looks it up again
            return
        self._check_hit(rid, hit)
        self._admit_with(data, rid, hit)

    @precondition(
        lambda self: any(r.admitted and r.computed < len(r.tokens) for r in self.live.values())
    )
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        """One chunk of prefill (or the catch-up after a refused decode): allocate, then the
        model writes some or all of what has slots."""
        rid = self._pick(
            data, [rid for rid, r in self.live.items() if r.admitted and r.computed < len(r.tokens)]
        )
        req = self.live[rid]
        target = data.draw(st.integers(req.computed + 1, len(req.tokens)), label="target")
        if self._allocate(rid, target - req.computed):
            self._commit(rid, data.draw(st.integers(req.computed, req.scheduled), label="commit"))

    @precondition(
        lambda self: any(r.admitted and r.computed == len(r.tokens) for r in self.live.values())
    )
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = self._pick(
            data,
            [rid for rid, r in self.live.items() if r.admitted and r.computed == len(r.tokens)],
        )
        req = self.live[rid]
        self.manager.append_token_ids(rid, [token])
        req.tokens.append(token)
        self._touch(req)
        if self._allocate(rid, 1):
            self._commit(rid, len(req.tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reason=st.sampled_from(ENGINE_REASONS), twice=st.booleans())
    def free(self, data: st.DataObject, reason: FreeReason, twice: bool) -> None:
        rid = self._pick(data, list(self.live))
        req = self.live.pop(rid)
        self.stash.pop(rid, None)
        mgr = self.manager
        by_reason = mgr.stats().counters.frees_by_reason.get(reason, 0)
        assert mgr.free(rid, reason) == self._num_blocks_for(req.scheduled)
        assert not mgr.has_request(rid)
        assert mgr.stats().counters.frees_by_reason[reason] == by_reason + 1
        if twice:
            before, redundant = snapshot(mgr), mgr.stats().counters.redundant_frees
            assert mgr.free(rid, reason) == 0
            assert_unchanged(before, snapshot(mgr), "a second free")
            assert mgr.stats().counters.redundant_frees == redundant + 1
        if reason is FreeReason.PREEMPTED:  # recompute: back to the queue with all its tokens
            mgr.add_request(rid, req.tokens, cache_salt=req.salt)
            self.live[rid] = Req(list(req.tokens), req.salt, self.clock.now)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """The engine drops a request without freeing it (the leak the reaper exists for)."""
        rid = self._pick(data, list(self.live))
        self.abandoned[rid] = self.live.pop(rid)
        self.stash.pop(rid, None)

    @rule(
        dt=st.sampled_from([0.5, 4.0, 30.0]),
        timeout=st.sampled_from([IDLE_TIMEOUT_S, None]),
        tell_live=st.booleans(),
    )
    def tick_and_reap(self, dt: float, timeout: float | None, tell_live: bool) -> None:
        """Time passes; the reaper frees what is not live (when the engine tells its live set)
        and what holds blocks while idle past the timeout, never a live request holding nothing."""
        self.clock.now += dt
        mgr = self.manager
        now = self.clock.now
        expected = {rid for rid in self.abandoned if tell_live} | {
            rid
            for rid, r in {**self.live, **self.abandoned}.items()
            if timeout is not None and r.scheduled and now - r.last_active > timeout
        }
        reclaimed = sum(len(mgr.block_table(rid)) for rid in expected)
        before = mgr.stats().counters
        live = set(self.live) if tell_live else None
        assert set(mgr.reap(timeout, live_request_ids=live)) == expected
        after = mgr.stats().counters
        assert after.reclaimed_blocks == before.reclaimed_blocks + reclaimed
        assert after.reaped_requests == before.reaped_requests + len(expected)
        if expected:
            event("reaped")
        for rid in expected:  # the engine fails what was reaped
            self.live.pop(rid, None)
            self.abandoned.pop(rid, None)
            self.stash.pop(rid, None)

    @rule()
    def reset_prefix_cache(self) -> None:
        is_idle = self.manager.stats().num_held_blocks == 0
        assert self.manager.reset_prefix_cache() is is_idle
        if is_idle:
            assert not self.manager.pool.cached

    # -- invariants, after every step -------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        if self.mgr is None:
            return
        mgr = self.mgr
        report = mgr.audit(live_request_ids={*self.live, *self.abandoned})
        assert report.ok, report.describe()
        census = report.num_free_uncached + report.num_free_cached + report.num_held
        assert census == self.num_blocks, report.describe()
        stats = mgr.stats()
        assert stats.num_free_blocks == report.num_free_uncached + report.num_free_cached
        assert stats.num_cached_free_blocks == report.num_free_cached
        assert stats.num_held_blocks == report.num_held
        assert stats.num_live_requests == len(self.live) + len(self.abandoned)

    @invariant()
    def leaks_are_named(self) -> None:
        if self.mgr is None:
            return
        report = self.mgr.audit(live_request_ids=set(self.live))
        leaked = {v.request_id for v in report.violations if v.kind is ViolationKind.LEAK}
        assert leaked == set(self.abandoned), report.describe()
        held_while_idle = not self.live and report.num_held > 0
        expected = {ViolationKind.LEAK} if self.abandoned else set()
        expected |= {ViolationKind.HELD_WHILE_IDLE} if held_while_idle else set()
        assert report.kinds() == expected, report.describe()

    @invariant()
    def every_request_verifies_and_matches_the_model(self) -> None:
        if self.mgr is None:
            return
        for rid, req in {**self.live, **self.abandoned}.items():
            self.mgr.verify(rid)
            assert self.mgr.num_computed_tokens(rid) == req.computed
            assert len(self.mgr.block_table(rid)) == self._num_blocks_for(req.scheduled)

    @invariant()
    def kv_events_track_the_hash_map(self) -> None:
        if self.mgr is None:
            return
        for kv_event in self.mgr.drain_events():
            if isinstance(kv_event, BlockStored):
                assert not self.index & set(kv_event.block_hashes), "stored twice without removal"
                self.index |= set(kv_event.block_hashes)
            elif isinstance(kv_event, BlockRemoved):
                assert set(kv_event.block_hashes) <= self.index, "removed a block never stored"
                self.index -= set(kv_event.block_hashes)
                self.num_removed += len(kv_event.block_hashes)
            else:
                assert isinstance(kv_event, AllBlocksCleared)
                self.index.clear()
        assert self.index == set(self.mgr.pool.cached)
        assert self.num_removed == self.mgr.stats().counters.evicted_blocks

    @invariant()
    def free_queue_reuses_uncached_blocks_first(self) -> None:
        """Freed uncached blocks go to the head, freed cached ones to the tail: every cached
        free block is evicted only after all uncached free blocks are used."""
        if self.mgr is None:
            return
        cached = [b.is_cached for b in self.mgr.pool.free_queue]
        assert cached == sorted(cached), self.mgr.pool.free_queue.block_ids()

    def teardown(self) -> None:
        if self.mgr is None:
            return
        for rid in [*self.live, *self.abandoned]:
            self.mgr.free(rid, FreeReason.ABORTED)
        idle = self.mgr.check_idle()
        assert idle.ok, idle.describe()
        assert self.mgr.stats().num_free_blocks == self.num_blocks
        assert sorted(self.mgr.pool.free_queue.block_ids()) == list(range(self.num_blocks))


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    database=None,  # CI: no example database written into the checkout
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_surviving_prefix_is_a_contiguous_head_after_a_retried_prompt() -> None:
    mgr = KVCacheManager(8, 2, clock=FakeClock())
    prompt = [1, 2, 3, 4, 5, 6, 7]
    # A client retries while its first attempt is still running: same prompt, no hit yet.
    for rid in ("first", "retry"):
        mgr.add_request(rid, prompt)
        assert mgr.lookup(rid).num_tokens == 0
    assert mgr.allocate_slots("first", 7) is not None
    assert mgr.allocate_slots("retry", 4) is not None
    mgr.commit("first", 4)  # caches the two head blocks
    mgr.commit("retry", 4)  # duplicates: refused, stay uncached
    assert mgr.allocate_slots("retry", 3) is not None
    mgr.commit("retry", 7)  # its third block is cached, chained to first's head
    mgr.commit("first", 7)  # duplicate of retry's third block: refused
    mgr.free("first")
    mgr.free("retry")
    mgr.add_request("other", [9] * 12)
    assert mgr.allocate_slots("other", 12) is not None  # 6 blocks: evicts exactly one cached block
    assert mgr.audit(live_request_ids={"other"}).ok
    cached = mgr.pool.cached
    orphans = [
        b.block_id
        for b in cached.values()
        if b.parent_hash is not None and b.parent_hash not in cached
    ]
    assert not orphans, f"cached blocks {orphans} survive their evicted parent"
