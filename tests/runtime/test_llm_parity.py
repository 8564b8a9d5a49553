"""Token-for-token parity of greedy output with transformers, through the whole engine."""

from __future__ import annotations

import pytest

from kvserve.engine import SamplingParams
from tests.runtime.conftest import (
    PARITY_ARCHS,
    assert_no_blocks_held,
    hf_greedy,
    make_engine,
    random_prompt,
    run_to_completion,
)
from tests.runtime.conftest import (
    generate as generate_all,
)

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def generate(engine, prompts: dict[str, list[int]], params=GREEDY) -> dict[str, list[int]]:
    return generate_all(engine, prompts, params)


@pytest.fixture(params=PARITY_ARCHS)
def arch(request) -> str:
    return request.param


def test_single_request(arch, checkpoints):
    path = checkpoints[arch]
    prompt = random_prompt(9, seed=1)
    assert generate(make_engine(path), {"a": prompt})["a"] == hf_greedy(path, prompt, 12)


def test_mixed_batch_of_different_lengths(arch, checkpoints):
    path = checkpoints[arch]
    prompts = {f"r{n}": random_prompt(n, seed=n) for n in (3, 11, 26, 40)}
    engine = make_engine(path)
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(path, prompt, 12), rid
    assert_no_blocks_held(engine)


def test_warm_prefix_cache_equals_cold(arch, checkpoints):
    path = checkpoints[arch]
    prefix = random_prompt(24, seed=5)
    prompt = prefix + random_prompt(5, seed=6)
    engine = make_engine(path)
    generate(engine, {"warmup": prefix + random_prompt(3, seed=7)})
    engine.add_request("warm", prompt, GREEDY)
    done = run_to_completion(engine)
    assert done["warm"].num_cached_tokens == 24
    assert done["warm"].outputs[0].token_ids == hf_greedy(path, prompt, 12)


def test_chunked_prefill_with_a_tiny_budget(arch, checkpoints):
    path = checkpoints[arch]
    prompts = {f"c{n}": random_prompt(n, seed=100 + n) for n in (7, 19, 33)}
    engine = make_engine(path, max_num_batched_tokens=5)
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(path, prompt, 12), rid


def test_forced_preemption(arch, checkpoints):
    path = checkpoints[arch]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = {f"p{n}": random_prompt(n, seed=200 + n) for n in (6, 9, 13)}
    engine = make_engine(path, num_kv_blocks=14)
    got = generate(engine, prompts, params)
    assert engine.core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(path, prompt, 20), rid
    assert_no_blocks_held(engine)


def test_n_samples_share_the_prompt(arch, checkpoints):
    path = checkpoints[arch]
    prompt = random_prompt(21, seed=9)
    engine = make_engine(path)
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=12, temperature=0,
                                                    ignore_eos=True))
    done = run_to_completion(engine)["n3"]
    expected = hf_greedy(path, prompt, 12)
    assert [o.token_ids for o in done.outputs] == [expected] * 3
    assert done.num_cached_tokens == 20  # siblings hit the prompt's five full blocks
    assert_no_blocks_held(engine)


def test_a_burst_sharing_a_prefix_prefills_in_one_step(arch, checkpoints):
    # The first request writes the 6-block prefix; the others share its blocks in flight and
    # attend to them through the prefill cascade, all in the same forward pass.
    path = checkpoints[arch]
    prefix = random_prompt(24, seed=11)
    prompts = {f"b{i}": prefix + random_prompt(n, seed=12 + i) for i, n in enumerate((3, 5, 5, 2))}
    engine = make_engine(path)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    first_step = engine.step()
    assert sorted(o.request_id for o in first_step if o.outputs[0].token_ids) == sorted(prompts)
    done = run_to_completion(engine)
    for rid, prompt in prompts.items():
        assert done[rid].outputs[0].token_ids == hf_greedy(path, prompt, 12), rid
    assert sorted(done[rid].num_cached_tokens for rid in prompts) == [0, 24, 24, 24]
    assert_no_blocks_held(engine)
