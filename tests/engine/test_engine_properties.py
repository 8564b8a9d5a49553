"""Property: whatever the workload, budget, cache size, aborts and deadlines, every request that
completes gives the reference tokens, and the engine drains to zero held blocks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine import FinishReason, Request, SamplingParams
from tests.engine.conftest import make_rig
from tests.engine.toy_model import reference_generate

PREFIXES = [list(range(1, 13)), list(range(30, 38)), [5, 5, 5, 5, 5]]

workloads = st.lists(
    st.tuples(
        st.integers(0, len(PREFIXES) - 1),  # shared prefix
        st.lists(st.integers(0, 49), min_size=1, max_size=6),  # unique suffix
        st.integers(1, 12),  # max_tokens
        st.one_of(st.none(), st.integers(0, 30)),  # abort after this many steps
        st.one_of(st.none(), st.floats(0.0, 0.4)),  # deadline
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    num_blocks=st.integers(9, 40),
    block_size=st.sampled_from([2, 3, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
)
def test_any_workload_gives_reference_tokens_and_leaks_nothing(
    workload, num_blocks, block_size, budget, max_num_seqs
):
    rig = make_rig(num_blocks, block_size, budget, max_num_seqs, max_model_len=64)
    prompts: dict[str, list[int]] = {}
    expected, aborts = {}, {}
    for i, (prefix_idx, suffix, max_tokens, abort_at, deadline) in enumerate(workload):
        prompt = PREFIXES[prefix_idx] + suffix
        rid = f"r{i}"
        try:
            rig.core.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                     temperature=0),
                                         deadline=deadline))
        except ValueError:
            assert len(prompt) >= min(64, num_blocks * block_size)
            continue
        expected[rid] = reference_generate(prompt, max_tokens)
        prompts[rid] = prompt
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(rid)
    step = 0
    while rig.core.has_unfinished:
        rig.core.abort(aborts.pop(step, []))
        rig.step()
        step += 1
        assert step < 5000
    for rid, tokens in expected.items():
        delta = rig.finished[rid]
        if delta.finish_reason is FinishReason.LENGTH:
            got = rig.tokens[rid]
            # All max_tokens, or cut where the sequence filled the whole cache.
            limit = min(64, num_blocks * block_size) - len(prompts[rid])
            assert got == tokens[: len(got)] and len(got) in (len(tokens), limit), rid
        else:
            assert delta.finish_reason in (FinishReason.ABORT, FinishReason.TIMEOUT)
            assert rig.tokens.get(rid, []) == tokens[: len(rig.tokens.get(rid, []))]
    assert rig.kv.stats().num_held_blocks == 0
    assert rig.kv.check_idle().ok
    assert all(a.ok for a in rig.audits), [a.describe() for a in rig.audits if not a.ok]
