"""The stateful cache test with every tier: a disk tier under the host tier, and preemption by
swapping, interleaved at random with everything test_stateful.py's engine does, checked after
every step by the same model (stateful_model.py)."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from tests.kvcache.stateful_model import EngineModel, assert_unchanged, snapshot
from tests.kvcache.test_stateful import HostTierMachine, KVCacheMachine


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
