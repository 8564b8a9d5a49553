"""The engine over the real cache: exact outputs under batching, chunking, preemption, abort."""

from __future__ import annotations

import pytest

from kvserve.engine import FinishReason, Request, SamplingParams, SchedulerConfig
from tests.engine.conftest import make_rig
from tests.engine.toy_model import reference_generate

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def request(rid: str, prompt: list[int], params: SamplingParams = GREEDY, **kw) -> Request:
    return Request(rid, prompt, params, **kw)


def assert_clean(rig) -> None:
    assert not rig.core.has_unfinished
    stats = rig.kv.stats()
    assert stats.num_held_blocks == 0 and stats.num_live_requests == 0
    assert rig.kv.check_idle().ok
    assert all(a.ok for a in rig.audits), [a.describe() for a in rig.audits if not a.ok]


def test_single_request_matches_reference():
    rig = make_rig()
    rig.core.add_request(request("a", [3, 1, 4, 1, 5]))
    rig.drain()
    assert rig.tokens["a"] == reference_generate([3, 1, 4, 1, 5], 10)
    assert rig.finished["a"].finish_reason is FinishReason.LENGTH
    assert_clean(rig)


def test_chunked_prefill_respects_the_budget_and_matches_reference():
    rig = make_rig(budget=5)
    prompts = {f"r{i}": [i + 1] * 3 + list(range(10 + i, 27 + i)) for i in range(4)}
    for rid, prompt in prompts.items():
        rig.core.add_request(request(rid, prompt))
    seen_budgets = []
    while rig.core.has_unfinished:
        out_before = rig.model.tokens_computed
        rig.step()
        seen_budgets.append(rig.model.tokens_computed - out_before)
    assert max(seen_budgets) == 5
    for rid, prompt in prompts.items():
        assert rig.tokens[rid] == reference_generate(prompt, 10)
    assert_clean(rig)


def test_warm_prefix_cache_skips_computed_tokens_and_gives_the_same_tokens():
    rig = make_rig()
    prefix = list(range(1, 17))
    rig.core.add_request(request("cold", prefix + [40, 41]))
    rig.drain()
    computed = rig.model.tokens_computed
    rig.core.add_request(request("warm", prefix + [42]))
    rig.drain()
    assert rig.finished["warm"].num_cached_tokens == 16
    assert rig.model.tokens_computed - computed == 1 + 9  # one prompt token, then decodes
    assert rig.tokens["warm"] == reference_generate(prefix + [42], 10)
    assert_clean(rig)


def test_preemption_by_recompute_gives_the_same_tokens():
    rig = make_rig(num_blocks=12, block_size=4, budget=32)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3, 7, 8, 9] for i in range(4)}
    params = SamplingParams(max_tokens=14, temperature=0)
    for rid, prompt in prompts.items():
        rig.core.add_request(request(rid, prompt, params))
    rig.drain()
    assert rig.core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert rig.tokens[rid] == reference_generate(prompt, 14), rid
    assert_clean(rig)


def test_preemption_victim_is_the_most_recently_admitted():
    rig = make_rig(num_blocks=6, block_size=4, budget=64)
    for start, rid in ((1, "old"), (20, "new")):
        prompt = list(range(start, start + 7))
        rig.core.add_request(request(rid, prompt, SamplingParams(max_tokens=8, temperature=0)))
    for _ in range(12):
        rig.step()
        if rig.core.scheduler.num_preemptions:
            break
    running = [r.request_id for r in rig.core.scheduler.running]
    assert rig.core.scheduler.num_preemptions == 1 and running == ["old"]
    rig.drain()
    assert_clean(rig)


@pytest.mark.parametrize("when", [0, 1, 2, 5])
def test_abort_at_any_point_frees_everything(when):
    rig = make_rig(budget=4)
    rig.core.add_request(request("a", list(range(1, 14))))
    rig.core.add_request(request("b", list(range(1, 10))))
    for _ in range(when):
        rig.step()
    rig.core.abort(["a", "missing"])
    rig.drain()
    assert rig.finished["a"].finish_reason is FinishReason.ABORT
    assert rig.tokens["b"] == reference_generate(list(range(1, 10)), 10)
    assert_clean(rig)


def test_deadline_expires_waiting_and_running_requests():
    rig = make_rig(budget=4, max_num_seqs=1)
    rig.core.add_request(request("running", list(range(1, 9)), deadline=0.05))
    rig.core.add_request(request("waiting", list(range(1, 9)), deadline=0.02))
    rig.drain()
    assert {rid: d.finish_reason for rid, d in rig.finished.items()} == {
        "running": FinishReason.TIMEOUT, "waiting": FinishReason.TIMEOUT}
    assert_clean(rig)


def test_first_token_deadline_ends_only_requests_without_a_token():
    # One sequence at a time, 4 tokens a step: "first" prefills in 2 steps (t=0.00, 0.01) and
    # has its first token by t=0.02; "queued" waits behind it and has none by its deadline.
    rig = make_rig(budget=4, max_num_seqs=1)
    long = SamplingParams(max_tokens=20, temperature=0)
    rig.core.add_request(request("first", list(range(1, 9)), long, first_token_deadline=0.025))
    rig.core.add_request(request("queued", list(range(1, 9)), long, first_token_deadline=0.025))
    rig.drain()
    assert rig.finished["queued"].finish_reason is FinishReason.TIMEOUT
    assert rig.tokens.get("queued", []) == []
    # the deadline no longer applies once a token is out: "first" runs to its length
    assert rig.finished["first"].finish_reason is FinishReason.LENGTH
    assert rig.tokens["first"] == reference_generate(list(range(1, 9)), 20)
    assert_clean(rig)


def test_prompts_that_can_never_run_are_refused_up_front():
    rig = make_rig(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="too long"):
        rig.core.add_request(request("big", list(range(16))))
    rig2 = make_rig(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len 8"):
        rig2.core.add_request(request("long", list(range(8))))
    assert not rig.core.has_unfinished and not rig2.core.has_unfinished


def test_max_model_len_ends_generation_with_length():
    rig = make_rig(max_model_len=10)
    rig.core.add_request(request("a", list(range(1, 7)), SamplingParams(max_tokens=100,
                                                                          temperature=0)))
    rig.drain()
    assert len(rig.tokens["a"]) == 4 and rig.finished["a"].finish_reason is FinishReason.LENGTH


def test_eos_stop_token_ids_and_ignore_eos():
    prompt = [1, 2, 3]
    ref = reference_generate(prompt, 10)
    eos = ref[2]
    rig = make_rig()
    rig.core.add_request(request("eos", prompt, eos_token_ids=frozenset({eos})))
    rig.core.add_request(request("ignore", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                                  ignore_eos=True),
                                 eos_token_ids=frozenset({eos})))
    rig.core.add_request(request("stop_id", prompt, SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=(ref[4],))))
    rig.drain()
    assert rig.tokens["eos"] == ref[: ref.index(eos) + 1]
    assert rig.finished["eos"].finish_reason is FinishReason.STOP
    assert rig.tokens["ignore"] == ref
    assert rig.tokens["stop_id"] == ref[: ref.index(ref[4]) + 1]


def test_stop_strings_are_cut_and_never_streamed():
    prompt = [1, 2, 3]
    ref = reference_generate(prompt, 10)
    full = "".join(chr(ord("a") + t % 26) if t < 26 else chr(ord("A") + t % 26) for t in ref)
    stop = full[4:6]
    rig = make_rig(decoder=True)
    rig.core.add_request(request("s", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                              stop=[stop])))
    rig.drain()
    assert rig.text["s"] == full[: full.index(stop)]
    assert rig.finished["s"].finish_reason is FinishReason.STOP
    assert_clean(rig)


def test_group_siblings_wait_for_the_shared_prompt_then_hit_it():
    rig = make_rig(budget=64)
    prompt = list(range(1, 18))
    for i in range(3):
        rig.core.add_request(request(f"g-{i}", prompt, group_id="g"))
    rig.drain()
    cached = sorted(rig.finished[f"g-{i}"].num_cached_tokens for i in range(3))
    assert cached == [0, 16, 16]
    assert all(rig.tokens[f"g-{i}"] == reference_generate(prompt, 10) for i in range(3))
    assert_clean(rig)


def test_corruption_fails_only_the_affected_request():
    rig = make_rig()
    rig.core.add_request(request("victim", list(range(1, 10))))
    rig.core.add_request(request("bystander", list(range(20, 29))))
    rig.step()
    block_id = rig.kv.block_table("victim")[0]
    rig.kv.pool.blocks[block_id].epoch += 1  # as if an eviction bug reassigned it
    rig.drain()
    victim = rig.finished["victim"]
    assert victim.finish_reason is FinishReason.ERROR
    assert "cache corruption detected" in (victim.error or "") and "'victim'" in victim.error
    assert rig.tokens["bystander"] == reference_generate(list(range(20, 29)), 10)
    assert rig.kv.counters.corruption_detections == 1


def test_idle_check_reclaims_a_leak_and_reports_it():
    rig = make_rig()
    rig.core.add_request(request("a", [1, 2, 3, 4, 5]))
    rig.drain()
    rig.kv.add_request("orphan", [1, 2, 3, 4, 5])  # something outside the engine held blocks
    assert rig.kv.allocate_slots("orphan", 5) is not None
    rig.core.add_request(request("b", [9, 9]))
    rig.drain()
    failed = [a for a in rig.audits if not a.ok]
    assert failed and "orphan" in failed[-1].describe()
    assert rig.kv.counters.reclaimed_blocks == 2
    assert rig.kv.stats().num_held_blocks == 0


def test_drains_run_the_idle_check_and_the_full_audit_at_most_once_per_interval():
    rig = make_rig(audit_interval_steps=0, idle_audit_interval_s=60.0)
    full_runs = []
    for i, now in enumerate((0.0, 30.0, 59.0, 61.0, 100.0)):
        rig.clock.now = now
        rig.core.add_request(request(f"r{i}", [3, 1, 4, 1, 5]))
        rig.drain()
        full_runs.append(rig.kv.stats().counters.audit_runs)
    assert full_runs == [1, 1, 1, 2, 2]  # at 0 and 61 s (60 s after the last full one)
    assert rig.kv.stats().counters.idle_checks == 3
    assert len(rig.audits) == 5 and all(a.ok for a in rig.audits)  # one report per drain


def test_idle_audit_interval_must_not_be_negative():
    with pytest.raises(ValueError, match="idle_audit_interval_s"):
        SchedulerConfig(idle_audit_interval_s=-1)


def test_deltas_carry_first_scheduled_time_and_preemptions():
    """What vLLM's request phase histograms need: when a request first ran (not when a
    preempted one ran again) and how often it was preempted."""
    rig = make_rig(num_blocks=6, block_size=4, budget=64, max_num_seqs=1)
    start = rig.clock.now
    for start_token, rid in ((1, "first"), (20, "second")):
        prompt = list(range(start_token, start_token + 7))
        rig.core.add_request(request(rid, prompt, SamplingParams(max_tokens=4, temperature=0)))
    rig.drain()
    first, second = rig.finished["first"], rig.finished["second"]
    assert first.scheduled_time == start  # admitted by the first step
    assert second.scheduled_time is not None and second.scheduled_time > start  # it waited
    assert first.num_preemptions == second.num_preemptions == 0
    assert_clean(rig)
    # preempted requests keep the time they first ran
    rig = make_rig(num_blocks=6, block_size=4, budget=64)
    for start_token, rid in ((1, "old"), (20, "new")):
        prompt = list(range(start_token, start_token + 7))
        rig.core.add_request(request(rid, prompt, SamplingParams(max_tokens=8, temperature=0)))
    admitted = rig.clock.now
    rig.drain()
    assert rig.core.scheduler.num_preemptions >= 1
    assert rig.finished["new"].num_preemptions >= 1
    assert rig.finished["new"].scheduled_time == admitted
