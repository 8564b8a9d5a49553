"""Greedy token parity of tensor parallelism: TP=2 (two processes over gloo) equals TP=1 and
transformers, token for token, through the whole engine: a mixed batch, a warm prefix cache,
chunked prefill and forced preemption."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvserve.engine import SamplingParams
from kvserve.model.tensor_parallel import ShardingError
from kvserve.runtime import EngineArgs, LLMEngine
from tests.runtime.conftest import (
    assert_no_blocks_held,
    hf_greedy,
    make_engine,
    random_prompt,
    run_to_completion,
)
from tests.runtime.conftest import (
    generate as generate_all,
)
from tests.tp.conftest import PARITY_ARCHS

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@contextmanager
def tp_engine(path, **overrides) -> Iterator[LLMEngine]:
    engine = make_engine(path, tensor_parallel_size=2, **overrides)
    try:
        yield engine
    finally:
        engine.close()


def generate(engine, prompts: dict[str, list[int]], params=GREEDY) -> dict[str, list[int]]:
    return generate_all(engine, prompts, params)


@pytest.fixture(params=PARITY_ARCHS)
def arch(request) -> str:
    return request.param


def test_mixed_batch_then_warm_prefix_cache(arch, tp_checkpoints):
    path = tp_checkpoints[arch]
    prompts = {f"r{n}": random_prompt(n, seed=n) for n in (3, 11, 26, 40)}
    prefix = random_prompt(24, seed=5)
    warm = prefix + random_prompt(5, seed=6)
    single = make_engine(path)
    want = generate(single, prompts)
    want_warm = generate(single, {"warm": warm})["warm"]
    with tp_engine(path) as engine:
        got = generate(engine, prompts)
        generate(engine, {"warmup": prefix + random_prompt(3, seed=7)})
        engine.add_request("warm", warm, GREEDY)
        done = run_to_completion(engine)
        assert done["warm"].num_cached_tokens == 24
        assert_no_blocks_held(engine)
        stats = engine.collective_stats.snapshot()
    for rid, prompt in prompts.items():
        assert got[rid] == want[rid] == hf_greedy(path, prompt, 12), rid
    assert done["warm"].outputs[0].token_ids == want_warm == hf_greedy(path, warm, 12)
    # Two all_reduces per layer per step, one step check, two broadcasts: all timed.
    ops = {op for op, _ in stats.durations}
    assert ops == {"all_reduce", "all_gather", "broadcast"}
    steps = stats.durations[("all_gather", "gloo")].count
    assert stats.durations[("all_reduce", "gloo")].count == 2 * 2 * steps
    assert stats.rank_skew.count == steps - 1 and not stats.errors


def test_chunked_prefill_and_forced_preemption(arch, tp_checkpoints):
    path = tp_checkpoints[arch]
    prompts = {f"p{n}": random_prompt(n, seed=200 + n) for n in (6, 9, 13, 19)}
    with tp_engine(path, num_kv_blocks=14, max_num_batched_tokens=5) as engine:
        got = generate(engine, prompts, LONG)
        assert engine.core.scheduler.num_preemptions > 0
        assert_no_blocks_held(engine)
    single = make_engine(path, num_kv_blocks=14, max_num_batched_tokens=5)
    want = generate(single, prompts, LONG)
    for rid, prompt in prompts.items():
        assert got[rid] == want[rid] == hf_greedy(path, prompt, 20), rid


@pytest.mark.parametrize("name", ["qwen3_qk_norm", "mistral_sliding", "llama_bias"])
def test_qwen3_mistral_and_row_parallel_biases_shard_too(name, tp_checkpoints):
    path = tp_checkpoints[name]
    prompts = {f"s{n}": random_prompt(n, seed=300 + n) for n in (5, 17, 30)}
    with tp_engine(path) as engine:
        got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(path, prompt, 12), rid


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(tp_checkpoints):
    with pytest.raises(ShardingError, match=r"num_attention_heads \(3\) is not divisible"):
        LLMEngine.from_args(EngineArgs(model=str(tp_checkpoints["mistral_three_heads"]),
                                       tensor_parallel_size=2))


def test_tensor_parallelism_refuses_the_host_tier():
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        EngineArgs(tensor_parallel_size=2, kv_host_tier_bytes=1 << 20)
