"""The CUDA path: NCCL between two GPUs, float32 parity with one GPU and a bf16 run. Skipped,
saying why, where this machine has fewer than two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import SamplingParams
from tests.runtime.conftest import make_engine, random_prompt, run_to_completion

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    NUM_GPUS < 2, reason=f"tensor parallelism over NCCL needs 2 CUDA devices; this machine has "
                         f"{NUM_GPUS} (torch {torch.__version__})")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _generate(engine, prompts):
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    done = run_to_completion(engine)
    return {rid: done[rid].outputs[0].token_ids for rid in prompts}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_tp2_runs_and_matches_one_gpu_in_float32(dtype, tp_checkpoints):
    path = tp_checkpoints["llama_gqa"]
    prompts = {f"g{n}": random_prompt(n, seed=500 + n) for n in (4, 17, 33)}
    single = make_engine(path, device="cuda", dtype=dtype)
    want = _generate(single, prompts)
    engine = make_engine(path, device="cuda", dtype=dtype, tensor_parallel_size=2)
    try:
        got = _generate(engine, prompts)
        stats = engine.collective_stats.snapshot()
    finally:
        engine.close()
    assert ("all_reduce", "nccl") in stats.durations
    if dtype == "float32":
        assert got == want
    else:
        assert all(len(t) == 12 for t in got.values())
