"""The stateful cache test with the tiers: a host tier under a small device pool (with KV
imported from prefill workers), then a disk tier under it and preemption by swapping, each
interleaved at random with everything test_stateful.py's engine does, checked after every step
by the same model (stateful_model.py)."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvserve.kvcache import FreeReason
from tests.kvcache.stateful_model import TENANTS, EngineModel, Req, assert_unchanged, snapshot
from tests.kvcache.test_stateful import PREFIXES, KVCacheMachine


class HostTierMachine(KVCacheMachine):
    """The same engine over a device pool small enough to evict all the time, with a host tier
    (sometimes smaller than the pool) that keeps what it evicts."""

    @initialize(
        num_blocks=st.integers(6, 14),
        block_size=st.integers(2, 3),
        num_host_slots=st.integers(1, 16),
    )
    def setup(self, num_blocks: int, block_size: int, num_host_slots: int) -> None:
        self._model = EngineModel(num_blocks, block_size, num_host_slots)

    @rule(
        salt=st.sampled_from(TENANTS),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        step_fails=st.sampled_from([False, False, False, True]),
    )
    def short_request(
        self, salt: str | None, prefix: tuple[int, ...], suffix: list[int], step_fails: bool
    ) -> None:
        """A request whose whole prompt runs in one step and that then finishes: it leaves its
        prefix cached, for later admissions to evict into the host tier and hit again. When its
        step fails, the step's copies are undone and the request ends with an error."""
        model = self.model
        rid = f"s{model.next_id}"
        model.next_id += 1
        tokens = [*prefix, *suffix]
        model.mgr.add_request(rid, tokens, cache_salt=salt)
        model.live[rid] = Req(tokens, salt, model.clock.now)
        hit = model.mgr.lookup(rid)
        model.check_hit(rid, hit)
        if model.allocate(rid, len(tokens) - hit.num_tokens, hit):
            if step_fails:
                model.fail_step()  # ends `rid` if it loaded from the host tier
                if model.live.pop(rid, None) is not None:
                    model.mgr.free(rid, FreeReason.ERROR)
            else:
                model.commit(rid, len(tokens))
                model.live.pop(rid)
                assert model.mgr.free(rid) == model.num_blocks_for(len(tokens))
            model.settle_if_idle()

    @rule(
        data=st.data(),
        salt=st.sampled_from(TENANTS),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        then=st.sampled_from(["attach", "attach", "cancel", "keep open"]),
    )
    def import_prompt(self, data: st.DataObject, salt: str | None, prefix: tuple[int, ...],
                      suffix: list[int], then: str) -> None:
        """KV for a prompt arrives from a prefill worker: some of its blocks are reserved and
        confirmed (the last one maybe left reserved), then the transfer fails (cancel), goes on
        (kept open), or completes and its request is queued (attach): admitted later by the
        ordinary rules, through the host-tier hit."""
        model, imports = self.model, self.model.mgr.imports
        assert imports is not None
        rid = f"i{model.next_id}"
        model.next_id += 1
        tokens = [*prefix, *suffix]
        plan = imports.open(rid, tokens, salt)
        num = data.draw(st.integers(0, plan.num_blocks), label="blocks received")
        bs = model.bs
        for offset in range(num):
            idx = plan.first_block + offset
            grant = imports.reserve(rid, idx, plan.block_hashes[offset])
            if grant is None:
                event("import: no host room")
                break
            if grant.needs_write and then != "attach" and offset == num - 1 and data.draw(
                    st.booleans(), label="leave the last one reserved"):
                break
            if grant.needs_write:
                imports.confirm(rid, grant)
            model.written.add((salt, tuple(tokens[: (idx + 1) * bs])))
        if then == "cancel":
            imports.cancel(rid)
        elif then == "keep open":
            model.open_imports.add(rid)
        else:
            imports.attach(rid)
            model.mgr.add_request(rid, tokens, cache_salt=salt)
            model.live[rid] = Req(tokens, salt, model.clock.now)
            event("import attached")

    @precondition(lambda self: self.model.open_imports)
    @rule(data=st.data())
    def end_open_import(self, data: st.DataObject) -> None:
        """A transfer that was still running fails or is aborted: its import is cancelled."""
        rid = self._pick(data, list(self.model.open_imports))
        self.model.open_imports.discard(rid)
        assert self.model.mgr.imports is not None
        self.model.mgr.imports.cancel(rid)
        assert rid not in self.model.mgr.imports.imports


HostTierMachine.TestCase.settings = settings(KVCacheMachine.TestCase.settings, max_examples=150)
TestHostTierMachine = HostTierMachine.TestCase


class DiskAndSwapMachine(HostTierMachine):
    """The host-tier engine with a disk tier under the host tier (what the host evicts goes
    there, and hits load from it), and preemption by swapping: running requests are swapped
    out to private host slots (or refused, when the host has no room) and swapped back in."""

    @initialize(
        num_blocks=st.integers(6, 14),
        block_size=st.integers(2, 3),
        num_host_slots=st.integers(1, 6),  # small: the disk tier sees much of the traffic
        num_disk_slots=st.integers(1, 16),
    )
    def setup(self, num_blocks: int, block_size: int, num_host_slots: int,
              num_disk_slots: int) -> None:
        self._model = EngineModel(num_blocks, block_size, num_host_slots, num_disk_slots)

    def _swappable(self) -> list[str]:
        return [rid for rid in (*self.model.prefilling(), *self.model.decoding())
                if self.model.live[rid].computed > 0]

    @precondition(lambda self: self._swappable())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        """Preempt by swapping: all or nothing; a refusal changes nothing but its count."""
        model = self.model
        rid = self._pick(data, self._swappable())
        req, mgr = model.live[rid], model.mgr
        host, transfers = mgr.transfers.host, mgr.transfers
        need = model.num_blocks_for(req.computed)
        room = len(host.free_ids) + sum(1 for s in host.lru.values() if s.pin_cnt == 0)
        fits = need <= room and not transfers.loads_of(rid)
        before, fallbacks = snapshot(mgr), mgr.stats().counters.swap_fallbacks
        num_private = len(host.private)
        assert mgr.swap_out(rid) is fits
        if not fits:
            event("swap refused: recompute")
            assert mgr.stats().counters.swap_fallbacks == fallbacks + 1
            after = snapshot(mgr)
            after["stats"] = before["stats"]  # only the fallback counter moved
            assert_unchanged(before, after, f"a refused swap_out({rid!r})")
            return
        event("swapped out")
        assert len(host.private) == num_private + need and mgr.is_swapped(rid)
        assert mgr.block_table(rid) == [] and mgr.num_computed_tokens(rid) == req.computed
        req.swapped, req.scheduled = True, req.computed
        model.stash.pop(rid, None)
        if data.draw(st.booleans(), label="step now"):
            model.run_step()

    @precondition(lambda self: self.model.swapped(resumable=True))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        """Resume a swapped-out request: all or nothing; its KV is back once the step ran."""
        model = self.model
        rid = self._pick(data, model.swapped(resumable=True))
        req, mgr = model.live[rid], model.mgr
        num_new = data.draw(st.integers(0, len(req.tokens) - req.computed), label="new")
        before = snapshot(mgr)
        if mgr.swap_in(rid, num_new) is None:
            event("swap-in refused")
            assert model.num_blocks_for(req.computed + num_new) > mgr.pool.num_free_blocks
            assert_unchanged(before, snapshot(mgr), f"a refused swap_in({rid!r})")
            return
        event("swapped in")
        req.swapped, req.scheduled = False, req.computed + num_new
        model.touch(req)
        assert len(mgr.block_table(rid)) == model.num_blocks_for(req.scheduled)
        if data.draw(st.booleans(), label="step now"):
            model.commit(rid, data.draw(st.integers(req.computed, req.scheduled), label="upto"))


DiskAndSwapMachine.TestCase.settings = settings(KVCacheMachine.TestCase.settings,
                                                max_examples=250)
TestDiskAndSwapMachine = DiskAndSwapMachine.TestCase
