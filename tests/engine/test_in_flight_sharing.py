"""A burst sharing a prefix computes it once, in one step, and every fault path stays exact."""

from __future__ import annotations

import pytest

from kvserve.engine import Request, SamplingParams
from kvserve.kvcache import CacheCorruption
from tests.engine.conftest import make_rig
from tests.engine.test_scheduler import assert_clean
from tests.engine.toy_model import reference_generate

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PREFIX = list(range(1, 17))  # four blocks of four
PROMPTS = {f"r{i}": PREFIX + [30 + i, 40 + i, 20 + i] for i in range(4)}


def add_burst(rig) -> None:
    for rid, prompt in PROMPTS.items():
        rig.core.add_request(Request(rid, prompt, GREEDY))


def assert_exact(rig) -> None:
    for rid, prompt in PROMPTS.items():
        assert rig.tokens[rid] == reference_generate(prompt, GREEDY.max_tokens), rid
    assert_clean(rig)


def test_a_burst_computes_its_shared_prefix_once_in_its_first_step():
    rig = make_rig(budget=64)
    add_burst(rig)
    deltas = rig.step()
    assert sorted(d.request_id for d in deltas if d.new_token_ids) == sorted(PROMPTS)
    assert rig.model.tokens_computed == len(PREFIX) + 3 * len(PROMPTS)
    rig.drain()
    assert sorted(rig.finished[r].num_cached_tokens for r in PROMPTS) == [0, 16, 16, 16]
    assert_exact(rig)


def test_a_chunked_writer_lends_the_blocks_of_each_chunk_in_its_step():
    rig = make_rig(budget=12)  # the first chunk writes three of the four prefix blocks
    add_burst(rig)
    rig.drain()
    decodes = len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert rig.model.tokens_computed == len(PREFIX) + 3 * len(PROMPTS) + decodes
    assert_exact(rig)


def test_joiners_of_a_writer_that_fails_verification_recompute_exactly(monkeypatch):
    rig = make_rig(budget=64)
    add_burst(rig)
    verify = rig.kv.verify
    failed = []

    def verify_failing_the_writer_once(request_id, checksums=None):
        if request_id == "r0" and not failed:
            failed.append(request_id)
            raise CacheCorruption(request_id, 0, 0, 1, "planted")
        return verify(request_id, checksums)

    monkeypatch.setattr(rig.kv, "verify", verify_failing_the_writer_once)
    deltas = rig.step()
    # The writer failed; its joiners left the step with it: nobody read an unwritten block.
    assert [d.request_id for d in deltas] == ["r0"] and rig.finished["r0"].error
    assert rig.model.num_steps == 0 and rig.kv.audit(rig.core.scheduler.live_request_ids).ok
    rig.drain()
    for rid in ("r1", "r2", "r3"):
        assert rig.tokens[rid] == reference_generate(PROMPTS[rid], GREEDY.max_tokens)
    assert_clean(rig)


def test_joiners_of_a_step_that_failed_recompute_exactly():
    rig = make_rig(budget=64)
    add_burst(rig)
    rig.model.fail_next = True
    with pytest.raises(RuntimeError, match="fell over"):
        rig.step()
    assert rig.kv.audit(rig.core.scheduler.live_request_ids).ok  # no share of unwritten KV
    rig.drain()
    assert_exact(rig)
