"""Random interleavings of everything an engine does to the cache, checked after every step.

A hypothesis state machine plays the engine: it adds requests (a few shared prefixes, random
suffixes, three tenants), admits them with their prefix hit (sometimes a hit stashed earlier in
the step), prefills in chunks, decodes, aborts / preempts / finishes (sometimes twice), forgets
some requests (leaks), advances a fake clock and reaps, all under memory pressure. Its own model
of the engine's live set and of what each tenant has written (stateful_model.py) is checked
against the cache after every step: the audit, `verify`, the block census, the KV-event index
and the hit rules. test_stateful_tiers.py runs the same engine over a host tier (evictions
offload, hits load, steps confirm or fail their copies, KV imported from a prefill worker lands
in host slots), then with a disk tier and swapping too.
"""

from __future__ import annotations

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

from kvserve.kvcache import FreeReason, PrefixHit
from kvserve.kvcache.host_tier import SlotState

# The model's checks are plain asserts: have pytest show their operands, as it does here.
from tests.kvcache.stateful_model import (
    TENANTS,
    EngineModel,
    Req,
    assert_unchanged,
    snapshot,
)

PREFIXES = (
    (1, 2, 3, 4, 5, 6, 7, 8),  # a system prompt
    (1, 2, 3, 4, 9, 9),  # shares its first half
    (20, 21, 22, 23, 24),
)
ENGINE_REASONS = tuple(r for r in FreeReason if r is not FreeReason.REAPED)
IDLE_TIMEOUT_S = 10.0


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._model: EngineModel | None = None

    @initialize(num_blocks=st.integers(12, 40), block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self._model = EngineModel(num_blocks, block_size)

    # -- helpers --------------------------------------------------------------------------

    @property
    def model(self) -> EngineModel:
        assert self._model is not None
        return self._model

    def _pick(self, data: st.DataObject, rids: list[str]) -> str:
        return data.draw(st.sampled_from(sorted(rids)), label="request")

    def _admit_with(self, data: st.DataObject, rid: str, hit: PrefixHit) -> None:
        req = self.model.live[rid]
        num_new = data.draw(st.integers(1, len(req.tokens) - hit.num_tokens), label="chunk")
        if self.model.allocate(rid, num_new, hit) and data.draw(st.booleans(), label="step now"):
            upto = data.draw(st.integers(req.computed, req.scheduled), label="commit to")
            self.model.commit(rid, upto)

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
        rid = f"r{self.model.next_id}"
        self.model.next_id += 1
        tokens = [*prefix, *suffix]
        self.model.mgr.add_request(rid, tokens, cache_salt=salt)
        self.model.live[rid] = Req(tokens, salt, self.model.clock.now)
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

    @precondition(lambda self: self.model.waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        self._admit(data, self._pick(data, self.model.waiting()))

    def _admit(self, data: st.DataObject, rid: str) -> None:
        before = snapshot(self.model.mgr)
        hit = self.model.mgr.lookup(rid)
        assert_unchanged(before, snapshot(self.model.mgr), "lookup")
        self.model.check_hit(rid, hit)
        self._admit_with(data, rid, hit)

    @precondition(lambda self: self.model.waiting())
    @rule()
    def stash_lookups(self) -> None:
        """The engine looks the whole waiting queue up now and allocates later in the step."""
        for rid in self.model.waiting():
            self.model.stash[rid] = hit = self.model.mgr.lookup(rid)
            self.model.check_hit(rid, hit)

    @precondition(lambda self: self.model.stashed())
    @rule(data=st.data())
    def admit_with_stashed_hit(self, data: st.DataObject) -> None:
        rid = self._pick(data, self.model.stashed())
        hit = self.model.stash.pop(rid)
        pool = self.model.mgr.pool
        if [pool.blocks[b].epoch for b in hit.block_ids] != list(hit.epochs) or (
                self._tier_hit_is_stale(rid, hit)):
            before = snapshot(self.model.mgr)
            num_new = len(self.model.live[rid].tokens) - hit.num_tokens
            with pytest.raises(ValueError, match="stale prefix hit"):
                self.model.mgr.allocate_slots(rid, num_new, hit)
            assert_unchanged(before, snapshot(self.model.mgr), "a refused stale hit")
            event("stale stashed hit refused")
            self._admit(data, rid)  # the engine looks it up again
            return
        self.model.check_hit(rid, hit)
        self._admit_with(data, rid, hit)

    def _tier_hit_is_stale(self, rid: str, hit: PrefixHit) -> bool:
        """Whether a host or disk slot of the hit no longer holds its block at its epoch."""
        transfers = self.model.mgr.transfers
        if transfers is None:
            return False
        hashes = self.model.mgr.ledger.get(rid).block_hashes[len(hit.block_ids) :]
        host = iter(zip(hit.host_slots, hit.host_epochs, strict=True))
        disk = iter(zip(hit.disk_slots, hit.disk_epochs, strict=True))
        order = hit.from_disk or (False,) * len(hit.host_slots)
        for block_hash, is_disk in zip(hashes, order, strict=False):
            slot_id, epoch = next(disk if is_disk else host)
            slot = (transfers.disk if is_disk else transfers.host).slots[slot_id]
            if slot.state is not SlotState.READY or slot.epoch != epoch or (
                    slot.block_hash != block_hash):
                return True
        return False

    @precondition(lambda self: self.model.prefilling())
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        """One chunk of prefill (or the catch-up after a refused decode): allocate, then the
        model writes some or all of what has slots."""
        rid = self._pick(data, self.model.prefilling())
        req = self.model.live[rid]
        target = data.draw(st.integers(req.computed + 1, len(req.tokens)), label="target")
        if self.model.allocate(rid, target - req.computed):
            upto = data.draw(st.integers(req.computed, req.scheduled), label="commit")
            self.model.commit(rid, upto)

    @precondition(lambda self: self.model.decoding())
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = self._pick(data, self.model.decoding())
        req = self.model.live[rid]
        self.model.mgr.append_token_ids(rid, [token])
        req.tokens.append(token)
        self.model.touch(req)
        if self.model.allocate(rid, 1):
            self.model.commit(rid, len(req.tokens))

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), reason=st.sampled_from(ENGINE_REASONS), twice=st.booleans())
    def free(self, data: st.DataObject, reason: FreeReason, twice: bool) -> None:
        rid = self._pick(data, list(self.model.live))
        req = self.model.live.pop(rid)
        self.model.stash.pop(rid, None)
        mgr = self.model.mgr
        by_reason = mgr.stats().counters.frees_by_reason.get(reason, 0)
        assert mgr.free(rid, reason) == self.model.num_blocks_held(req)
        assert not mgr.has_request(rid)
        assert mgr.stats().counters.frees_by_reason[reason] == by_reason + 1
        if twice:
            before, redundant = snapshot(mgr), mgr.stats().counters.redundant_frees
            assert mgr.free(rid, reason) == 0
            assert_unchanged(before, snapshot(mgr), "a second free")
            assert mgr.stats().counters.redundant_frees == redundant + 1
        if reason is FreeReason.PREEMPTED:  # recompute: back to the queue with all its tokens
            mgr.add_request(rid, req.tokens, cache_salt=req.salt)
            self.model.live[rid] = Req(list(req.tokens), req.salt, self.model.clock.now)
        self.model.settle_if_idle()

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """The engine drops a request without freeing it (the leak the reaper exists for)."""
        rid = self._pick(data, list(self.model.live))
        self.model.abandoned[rid] = self.model.live.pop(rid)
        self.model.stash.pop(rid, None)

    @rule(
        dt=st.sampled_from([0.5, 4.0, 30.0]),
        timeout=st.sampled_from([IDLE_TIMEOUT_S, None]),
        tell_live=st.booleans(),
    )
    def tick_and_reap(self, dt: float, timeout: float | None, tell_live: bool) -> None:
        """Time passes; the reaper frees what is not live (when the engine tells its live set)
        and what holds blocks while idle past the timeout, never a live request holding nothing."""
        self.model.clock.now += dt
        mgr = self.model.mgr
        now = self.model.clock.now
        expected = {rid for rid in self.model.abandoned if tell_live} | {
            rid
            for rid, r in {**self.model.live, **self.model.abandoned}.items()
            if timeout is not None and r.scheduled and not r.swapped
            and now - r.last_active > timeout
        }
        reclaimed = sum(len(mgr.block_table(rid)) for rid in expected)
        before = mgr.stats().counters
        live = set(self.model.live) if tell_live else None
        assert set(mgr.reap(timeout, live_request_ids=live)) == expected
        after = mgr.stats().counters
        assert after.reclaimed_blocks == before.reclaimed_blocks + reclaimed
        assert after.reaped_requests == before.reaped_requests + len(expected)
        if expected:
            event("reaped")
        for rid in expected:  # the engine fails what was reaped
            self.model.live.pop(rid, None)
            self.model.abandoned.pop(rid, None)
            self.model.stash.pop(rid, None)
        if mgr.imports is not None:  # open imports idle past the timeout were reaped too
            self.model.open_imports &= set(mgr.imports.imports)
        self.model.settle_if_idle()

    @precondition(lambda self: self.model.mgr.transfers is not None)
    @rule(fails=st.booleans())
    def step_copies(self, fails: bool) -> None:
        """A step ends with no commit (every chunk's KV still in flight elsewhere): its copies
        between the tiers are confirmed, or undone when the step fails."""
        if fails:
            self.model.fail_step()
            self.model.settle_if_idle()
        else:
            self.model.run_step()

    @rule()
    def reset_prefix_cache(self) -> None:
        transfers, imports = self.model.mgr.transfers, self.model.mgr.imports
        is_idle = self.model.mgr.stats().num_held_blocks == 0 and (
            transfers is None or (transfers.is_idle and not transfers.host.private)
        ) and not (imports and imports.imports)
        assert self.model.mgr.reset_prefix_cache() is is_idle
        if is_idle:
            assert not self.model.mgr.pool.cached

    # -- invariants, after every step -----------------------------------------------------

    @invariant()
    def the_cache_matches_the_model(self) -> None:
        """The books balance, leaks are named, every request verifies and matches the model,
        the KV events track the hash map, and the free queue reuses uncached blocks first."""
        if self._model is None:
            return
        self._model.check_books_balance()
        self._model.check_leaks_are_named()
        self._model.check_requests_verify_and_match()
        self._model.check_kv_events()
        self._model.check_free_queue_order()

    def teardown(self) -> None:
        if self._model is not None:
            self.model.check_teardown()


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    database=None,  # CI: no example database written into the checkout
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheMachine = KVCacheMachine.TestCase
