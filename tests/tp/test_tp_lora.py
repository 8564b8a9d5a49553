"""LoRA under tensor parallelism: each rank holds the shard of every adapter that matches its
shard of the base weights (B's rows for q/k/v and gate/up, A's columns for o and down), and
TP=2 with several adapters and the base model in one batch equals TP=1, tokens and logprobs,
offline and through `kvserve serve -tp 2 --enable-lora`."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from kvserve.engine import SamplingParams
from kvserve.model import load_model
from kvserve.model.lora import AdapterSharding, AdapterSlots, LoRAWeights, load_peft_adapter
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime import EngineArgs
from kvserve.runtime.tp.group_check import GroupIdentity
from tests.lora.adapters import write_peft_adapter
from tests.runtime.conftest import make_engine, random_prompt, run_to_completion
from tests.server.harness import ADMIN_KEY, ServerProcess
from tests.tp.parity import openai_client

pytest.importorskip("peft")
RANK = 8
TOL = 1e-3  # the TP parity tests' logprob tolerance (tests/tp/parity.py)


@pytest.fixture(scope="module")
def adapters(tp_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, list[Path]]:
    """Three adapters per base: every projection, q/v/down only, k/o/up with rsLoRA."""
    root = tmp_path_factory.mktemp("tp-lora")
    specs = [(None, False), (["q_proj", "v_proj", "down_proj"], False),
             (["k_proj", "o_proj", "up_proj"], True)]
    return {arch: [write_peft_adapter(tp_checkpoints[arch], root / f"{arch}-{i}", rank=RANK,
                                      seed=70 + i, targets=t, rslora=rs)
                   for i, (t, rs) in enumerate(specs)]
            for arch in ("qwen2_one_kv_head", "llama_gqa")}


def rank_slot(path: Path, weights: LoRAWeights, rank: int) -> AdapterSlots:
    """Rank `rank` of 2's slots with `weights` copied into slot 0, as `follow` copies them."""
    loaded = load_model(path, shard=ShardSpec(rank, 2))
    slots = AdapterSlots(loaded.model, 2, RANK, sharding=AdapterSharding(loaded.config,
                                                                         ShardSpec(rank, 2)))
    slots.begin_step([weights.digest], [0, 1], lambda _: weights)
    slots.end_step()
    return slots


@pytest.mark.parametrize("arch", ["qwen2_one_kv_head", "llama_gqa"])
def test_each_rank_holds_its_shard_of_the_adapter(arch, tp_checkpoints, adapters) -> None:
    path = tp_checkpoints[arch]
    full = load_model(path)
    config = full.config
    weights = load_peft_adapter(adapters[arch][0], config, RANK, torch.float32)
    hd, kv_heads = config.head_dim, config.num_key_value_heads
    q_local, inter_local = config.num_attention_heads * hd // 2, config.intermediate_size // 2
    kv_local = hd * max(1, kv_heads // 2)
    for rank in (0, 1):
        layer = rank_slot(path, weights, rank).layers[1]
        # The rows each rank holds of q, k (a KV head per rank, or the one head replicated) and
        # up, and the input columns of o and down: the base weights' split, derived here from
        # the head counts rather than from the sharding code under test.
        kv_first = rank * kv_local if kv_heads >= 2 else 0
        rows = {"q_proj": (rank * q_local, (rank + 1) * q_local),
                "k_proj": (kv_first, kv_first + kv_local),
                "up_proj": (rank * inter_local, (rank + 1) * inter_local)}
        cols = {"o_proj": (rank * q_local, (rank + 1) * q_local),
                "down_proj": (rank * inter_local, (rank + 1) * inter_local)}
        for kind, m, sub in (("qkv", 0, "q_proj"), ("qkv", 1, "k_proj"), ("gate_up", 1, "up_proj")):
            a, b = weights.modules[(1, sub)]  # [r, in], [out, r]
            start, stop = rows[sub]
            held_b = layer.b[kind][m][0]  # [out_local, R]
            assert held_b.shape == (stop - start, RANK), (rank, sub)
            assert torch.equal(held_b, b[start:stop]), (rank, sub)
            held_a = layer.a[kind][0, m * RANK : (m + 1) * RANK]  # [R, in]: A whole
            assert held_a.shape == a.shape and torch.equal(held_a, a), (rank, sub)
        for kind, sub in (("o", "o_proj"), ("down", "down_proj")):
            a, b = weights.modules[(1, sub)]
            start, stop = cols[sub]
            held_a = layer.a[kind][0]  # [R, in_local]
            assert held_a.shape == (RANK, stop - start), (rank, sub)
            assert torch.equal(held_a, a[:, start:stop]), (rank, sub)
            assert torch.equal(layer.b[kind][0][0], b), (rank, sub)  # B whole
        # The base weights went the same way: the adapter's shard sits on its base shard.
        local = load_model(path, shard=ShardSpec(rank, 2)).model.model.layers[1]
        base_q = full.model.model.layers[1].self_attn.q_proj.weight
        assert torch.equal(local.self_attn.q_proj.weight, base_q[slice(*rows["q_proj"])])


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2,
                        prompt_logprobs=2)


def run_mixed(path: Path, adapter_paths: list[Path], **overrides) -> tuple[dict, dict]:
    """Three adapters and the base model (one prompt twice: base and adapter) through an engine
    with two slots, so adapters share steps with the base and evict each other; the tokens
    and every logprob by request, and the engine's slot loads and evictions."""
    engine = make_engine(path, enable_lora=True, max_loras=2, max_lora_rank=RANK, **overrides)
    try:
        assert engine.lora is not None
        refs = [engine.lora.add(f"a{i}", str(p)).ref for i, p in enumerate(adapter_paths)]
        shared = random_prompt(9, seed=1)
        requests = [("base", shared, None), ("a0-same", shared, refs[0]),
                    ("a1", random_prompt(14, seed=2), refs[1]),
                    ("a2", random_prompt(5, seed=3), refs[2]),
                    ("base2", random_prompt(11, seed=4), None),
                    ("a0", random_prompt(7, seed=5), refs[0])]
        for rid, prompt, ref in requests:
            engine.add_request(rid, prompt, GREEDY, lora=ref)
        done = run_to_completion(engine)
        counts = {"loads": sum(engine.lora.loads.values()),
                  "evictions": sum(engine.lora.evictions.values())}
    finally:
        engine.close()
    return {rid: done[rid] for rid, _, _ in requests}, counts


def logprob_rows(out) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    entries = [e for e in out.prompt_logprobs if e is not None] + out.outputs[0].logprobs
    return [(e.token_id, e.logprob, e.top) for e in entries]


def assert_close_rows(got, want, rid: str) -> None:
    assert len(got) == len(want), rid
    for (tok, lp, top), (want_tok, want_lp, want_top) in zip(got, want, strict=True):
        assert tok == want_tok and abs(lp - want_lp) < TOL, (rid, lp, want_lp)
        assert [t for t, _ in top] == [t for t, _ in want_top], rid
        assert all(abs(a - b) < TOL for (_, a), (_, b) in zip(top, want_top, strict=True)), rid


@pytest.mark.parametrize("arch", ["qwen2_one_kv_head", "llama_gqa"])
def test_tp2_adapters_and_the_base_in_one_batch_equal_tp1(arch, tp_checkpoints,
                                                          adapters) -> None:
    path = tp_checkpoints[arch]
    want, want_counts = run_mixed(path, adapters[arch])
    got, got_counts = run_mixed(path, adapters[arch], tensor_parallel_size=2)
    assert got_counts == want_counts and want_counts["evictions"] > 0  # evicted, reloaded
    for rid, out in got.items():
        assert out.outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        assert_close_rows(logprob_rows(out), logprob_rows(want[rid]), rid)
    # The parity means something: the adapter moves the same prompt's output.
    assert logprob_rows(got["a0-same"])[0][1] != pytest.approx(logprob_rows(got["base"])[0][1],
                                                               abs=0.05)


def test_serve_tp2_with_lora_modules_matches_tp1(tp_checkpoints, adapters, tmp_path) -> None:
    arch = "llama_gqa"
    path, (a0, a1, a2) = tp_checkpoints[arch], adapters[arch]
    server = ServerProcess(path, tmp_path, ("--tensor-parallel-size", "2", "--block-size", "4",
                                            "--enable-lora", "--max-loras", "2",
                                            "--max-lora-rank", str(RANK), "--served-model-name",
                                            "tiny", "--lora-modules", f"a0={a0}", f"a1={a1}"))
    try:
        server.wait_healthy(timeout_s=120.0)
        load = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                          json={"lora_name": "a2", "lora_path": str(a2)})
        assert load.status_code == 200, load.text
        client = openai_client(server.url)
        prompt = random_prompt(10, seed=8)
        got, texts = {}, {}
        for model in ("tiny", "a0", "a1", "a2"):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=5,
                                            temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
            logprobs = out.choices[0].logprobs
            assert logprobs is not None and logprobs.token_logprobs
            got[model], texts[model] = logprobs.token_logprobs, out.choices[0].text
    finally:
        server.stop()
    engine = make_engine(path, enable_lora=True, max_loras=2, max_lora_rank=RANK)
    assert engine.lora is not None
    refs = {"tiny": None, **{f"a{i}": engine.lora.add(f"a{i}", str(p)).ref
                             for i, p in enumerate((a0, a1, a2))}}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    for model, ref in refs.items():
        engine.add_request(model, prompt, params, lora=ref)
    done = run_to_completion(engine)
    for model, logprobs in got.items():
        assert texts[model] == done[model].outputs[0].text, model
        want = [e.logprob for e in done[model].outputs[0].logprobs]
        assert all(abs(a - b) < TOL for a, b in zip(logprobs, want, strict=True)), model
    assert len({round(lp[0], 3) for lp in got.values()}) == 4  # four different outputs


def test_ranks_must_agree_on_the_adapter_slots(tp_checkpoints) -> None:
    """Rank 0 fills every rank's slots, so a node started with other LoRA flags is refused."""
    path = str(tp_checkpoints["llama_gqa"])
    lora = GroupIdentity.from_args(EngineArgs(model=path, tensor_parallel_size=2,
                                              enable_lora=True, max_loras=2))
    plain = GroupIdentity.from_args(EngineArgs(model=path, tensor_parallel_size=2))
    assert lora.differences(plain, 1) == [
        "--enable-lora/--max-loras/--max-lora-rank: rank 1 has 2 slots of rank 16, rank 0 has off"]
    assert not lora.differences(lora, 1)
