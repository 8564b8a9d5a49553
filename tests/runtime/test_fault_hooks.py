"""The test-only fault hooks: read only under KVSERVE_TEST_HOOKS=1, refused when malformed, and
the planted KV fault (a block reassigned under a live request) fails exactly that request,
naming the block and both epochs, counts the corruption and leaves no block held."""

from __future__ import annotations

import pytest

from kvserve.engine import FinishReason, SamplingParams
from kvserve.runtime.kv_faults import KVFault
from kvserve.runtime.tp.faults import Fault, FaultKind
from tests.runtime.conftest import (
    assert_no_blocks_held,
    make_engine,
    random_prompt,
    run_to_completion,
)

LONG = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_hooks_are_ignored_without_the_flag():
    assert KVFault.from_env({"KVSERVE_KV_FAULT": "reassign:3"}) is None
    assert Fault.from_env({"KVSERVE_TP_FAULT": "1:3:exit"}) is None
    hooks = {"KVSERVE_TEST_HOOKS": "1"}
    assert KVFault.from_env({**hooks, "KVSERVE_KV_FAULT": "reassign:3"}) == KVFault(3)
    fault = Fault.from_env({**hooks, "KVSERVE_TP_FAULT": "1:2-5:delay:0.1"})
    assert fault == Fault(1, 2, FaultKind.DELAY, 0.1, 5)
    assert [fault.applies(1, s) for s in (1, 2, 5, 6)] == [False, True, True, False]
    assert [fault.applies(0, s) for s in (2, 5)] == [False, False]
    single = Fault.from_env({**hooks, "KVSERVE_TP_FAULT": "1:3:exit"})
    assert single is not None and [single.applies(1, s) for s in (2, 3, 4)] == [False, True,
                                                                                 False]


@pytest.mark.parametrize("value", ["reassign", "reassign:0", "flip:3", "reassign:x"])
def test_a_malformed_kv_fault_is_refused(value):
    with pytest.raises(ValueError, match="expected reassign:<step>"):
        KVFault.from_env({"KVSERVE_TEST_HOOKS": "1", "KVSERVE_KV_FAULT": value})


def test_planted_reassignment_fails_its_request_by_name(checkpoints):
    engine = make_engine(checkpoints["llama_gqa"])
    engine.kv_fault = KVFault(2)
    engine.add_request("victim", random_prompt(9, seed=5), LONG)
    engine.step()  # the prefill: nothing running yet holds blocks before it
    victim_block = engine.kv_cache.block_table("victim")[-1]
    engine.add_request("bystander", random_prompt(9, seed=6), LONG)
    done = run_to_completion(engine)
    victim = done["victim"].outputs[0]
    assert victim.finish_reason is FinishReason.ERROR
    assert f"block {victim_block} (epoch seen 1, now 2)" in (victim.error or ""), victim.error
    assert len(done["bystander"].outputs[0].token_ids) == 12
    assert engine.kv_cache.counters.corruption_detections == 1
    assert_no_blocks_held(engine)
