"""--kv-cache-dtype: the cache's dtype as the engine resolves it, and a float32 model over a
bf16 cache (half the bytes a cached token) end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model import kv_cache_bytes_per_block, write_random_checkpoint
from kvserve.runtime import EngineArgs
from kvserve.runtime.model_setup import kv_cache_torch_dtype
from tests.model.arch_configs import base_config


@pytest.mark.parametrize(("asked", "model", "cache"), [
    ("auto", torch.float32, torch.float32), ("auto", torch.bfloat16, torch.bfloat16),
    ("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
    ("bf16", torch.float32, torch.bfloat16), ("bfloat16", torch.float32, torch.bfloat16),
    ("fp16", torch.float32, torch.float16), ("half", torch.float32, torch.float16),
    ("fp16", torch.float16, torch.float16)])
def test_the_cache_takes_the_models_dtype_or_16_bits_under_float32(asked, model, cache) -> None:
    assert kv_cache_torch_dtype(EngineArgs(kv_cache_dtype=asked), model) == cache


@pytest.mark.parametrize(("asked", "model"), [
    ("fp32", torch.bfloat16), ("fp16", torch.bfloat16), ("bf16", torch.float16)])
def test_other_pairings_are_refused_with_the_ones_that_work(asked, model) -> None:
    name = str(model).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"--kv-cache-dtype {asked}: a {name} model's "
                       r"attention reads a KV cache in its own dtype \(a float32 model's also "
                       r"in bf16 or fp16\); pass --kv-cache-dtype auto, or --dtype float32"):
        kv_cache_torch_dtype(EngineArgs(kv_cache_dtype=asked), model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = base_config() | {"intermediate_size": 512}  # every input width a multiple of 32
    return write_random_checkpoint(tmp_path_factory.mktemp("kvdtype") / "m", config, seed=7)


def _llm(model_dir: Path, kv_cache_dtype: str, **overrides: object) -> LLM:
    args = dict(model=str(model_dir), quantization="q4_1", kv_cache_dtype=kv_cache_dtype,
                kv_cache_memory_bytes=4 << 20, block_size=4, num_threads=1,
                enable_prefix_caching=True) | overrides
    return LLM(**args)


SIXTEEN_BITS = [("bf16", torch.bfloat16), ("fp16", torch.float16)]


@pytest.mark.parametrize(("asked", "dtype"), SIXTEEN_BITS)
def test_a_16_bit_cache_holds_twice_the_blocks_of_the_same_bytes(model_dir: Path, asked: str,
                                                                  dtype: torch.dtype) -> None:
    pytest.importorskip("gguf")
    wide, narrow = _llm(model_dir, "auto"), _llm(model_dir, asked, kv_host_tier_bytes=1 << 20)
    config = narrow.engine.runner.model.config
    assert kv_cache_bytes_per_block(config, 4, dtype) * 2 == \
        kv_cache_bytes_per_block(config, 4, torch.float32)
    assert narrow.engine.kv_cache.stats().num_blocks == 2 * wide.engine.kv_cache.stats().num_blocks
    caches = narrow.engine.runner.kv_caches + narrow.engine.runner.host_kv_caches
    assert narrow.engine.runner.host_kv_caches  # the host tier follows the cache's dtype
    assert all(t.dtype == dtype for c in caches for t in (c.key_cache, c.value_cache))
    assert next(narrow.engine.runner.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(("asked", "dtype"), SIXTEEN_BITS)
def test_a_prefix_cache_hit_reads_what_the_miss_attended_to(model_dir: Path, asked: str,
                                                            dtype: torch.dtype) -> None:
    """Over a 16-bit cache under a float32 model, the first request's prefill attends over its
    fresh K/V rounded as the cache stores them, so the second (a prefix-cache hit reading the
    stored rows) gives the same log-probabilities up to float32 summation order."""
    pytest.importorskip("gguf")
    llm = _llm(model_dir, asked)
    prompt = {"prompt_token_ids": list(range(10, 70))}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    miss, hit = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert hit.num_cached_tokens and not miss.num_cached_tokens
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    for got, want in zip(hit.outputs[0].logprobs, miss.outputs[0].logprobs, strict=True):
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        for (_, a), (_, b) in zip(got.top, want.top, strict=True):
            assert a == pytest.approx(b, abs=4e-4)  # unrounded fresh K/V: 1.3e-3 off
