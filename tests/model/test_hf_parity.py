"""Our paged model reproduces transformers' logits and greedy generations on the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model import load_model

from .arch_configs import ARCH_CONFIGS
from .paged_harness import PagedRunner

transformers = pytest.importorskip("transformers")


def hf_model(path: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    # HF silently random-inits what it cannot find; parity only means something if it found all.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=gen).tolist()


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_prefill_logits_match_transformers(arch: str, arch_checkpoints: dict[str, Path]) -> None:
    path = arch_checkpoints[arch]
    ours = load_model(path).model
    ids = prompt(23, ours.config.vocab_size, seed=7)  # > sliding window, spans 6 blocks of 4
    logits = PagedRunner(ours, block_size=4).step([("a", ids)])["a"]  # [23, vocab]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]  # [23, vocab]
    assert ref.abs().max() > 1.0  # logits are not trivially tiny
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def greedy_through_cache(runner: PagedRunner, prompts: dict[str, list[int]], max_new: int,
                         eos_ids: tuple[int, ...], stagger: int) -> dict[str, list[int]]:
    """Greedy decode all prompts in shared steps; prompt i joins at step i * stagger, so steps
    mix one sequence's prefill with the others' decodes."""
    outputs: dict[str, list[int]] = {seq: [] for seq in prompts}
    pending: dict[str, list[int]] = {}
    done: set[str] = set()
    step = 0
    while len(done) < len(prompts):
        for i, seq in enumerate(prompts):
            if step == i * stagger:
                pending[seq] = prompts[seq]
        chunks = [(seq, toks) for seq, toks in pending.items() if seq not in done]
        if chunks:
            logits = runner.step(chunks)
            for seq, _ in chunks:
                token = int(logits[seq][-1].argmax())
                outputs[seq].append(token)
                pending[seq] = [token]
                if token in eos_ids or len(outputs[seq]) == max_new:
                    done.add(seq)
        step += 1
    return outputs


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qk_norm", "mistral_sliding"])
def test_greedy_decode_matches_transformers_generate(arch: str,
                                                     arch_checkpoints: dict[str, Path]) -> None:
    path = arch_checkpoints[arch]
    loaded = load_model(path)
    vocab = loaded.config.vocab_size
    prompts = {"short": prompt(5, vocab, 1), "long": prompt(19, vocab, 2),
               "mid": prompt(11, vocab, 3)}
    runner = PagedRunner(loaded.model, num_blocks=48, block_size=4)
    ours = greedy_through_cache(runner, prompts, 20, loaded.eos_token_ids, stagger=3)
    hf = hf_model(path)
    for seq, ids in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                              eos_token_id=list(loaded.eos_token_ids), pad_token_id=0)
        assert ours[seq] == out[0, len(ids):].tolist(), seq


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qk_norm"])
def test_chunks_sharing_a_cached_prefix_match_transformers(
        arch: str, arch_checkpoints: dict[str, Path]) -> None:
    """Prefill chunks that read one cached head (the prefill cascade), then their decodes (the
    decode cascade), give HF's logits and greedy tokens for prefix + suffix."""
    path = arch_checkpoints[arch]
    loaded = load_model(path)
    vocab = loaded.config.vocab_size
    head = prompt(20, vocab, seed=11)  # 5 full blocks of 4
    suffixes = {"s1": prompt(6, vocab, 12), "s2": prompt(3, vocab, 13), "s3": prompt(6, vocab, 14)}
    runner = PagedRunner(loaded.model, num_blocks=48, block_size=4)
    runner.step([("head", head)])
    for seq in suffixes:
        runner.share_prefix("head", seq, 5)
    hf = hf_model(path)
    logits = runner.step(list(suffixes.items()))
    ours = {seq: [int(logits[seq][-1].argmax())] for seq in suffixes}
    for _ in range(5):
        step = runner.step([(seq, out[-1:]) for seq, out in ours.items()])
        for seq, out in ours.items():
            out.append(int(step[seq][-1].argmax()))
    for seq, suffix in suffixes.items():
        ids = torch.tensor([head + suffix])
        with torch.no_grad():
            ref = hf(ids).logits[0, len(head):]  # [suffix, vocab]
            gen = hf.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6,
                              pad_token_id=0)
        torch.testing.assert_close(logits[seq], ref, atol=1e-4, rtol=1e-4)
        assert ours[seq] == gen[0, ids.shape[1]:].tolist(), seq
