"""The sampler: exact greedy, filters that keep what they promise, seeds independent of batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.engine import Request, SamplingParams
from kvserve.model.sampler import Sampler

VOCAB = 12


def req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params))


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = logits_for(3)
    out = Sampler().sample(logits, [req(f"r{i}", temperature=0) for i in range(3)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_greedy_rows_among_sampled_rows_are_argmax():
    logits = logits_for(4, seed=6)
    sampler = Sampler(seed=3)
    for _ in range(5):
        out = sampler.sample(logits, [req("g0", temperature=0), req("s1", temperature=3.0),
                                      req("g2", temperature=0), req("s3", temperature=3.0)])
        assert [out[0].token_id, out[2].token_id] == logits[[0, 2]].argmax(-1).tolist()


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch():
    alone = Sampler(seed=1)
    busy = Sampler(seed=2)
    row = logits_for(1, seed=5)
    got_alone, got_busy = [], []
    for step in range(20):
        got_alone.append(alone.sample(row, [req("s", temperature=1.0, seed=42)])[0].token_id)
        others = [req(f"o{i}", temperature=0.7) for i in range(3)]
        batch = torch.cat([logits_for(2, seed=step), row, logits_for(1, seed=99 + step)])
        tokens = busy.sample(batch, [others[0], others[1], req("s", temperature=1.0, seed=42),
                                     others[2]])
        got_busy.append(tokens[2].token_id)
    assert got_alone == got_busy
    assert len(set(got_alone)) > 1  # it really sampled


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_for(4, seed=3)
    sampler = Sampler()
    for _ in range(5):
        out = sampler.sample(logits, [req("a", top_k=1), req("b", top_p=1e-6), req("c", min_p=1.0),
                                      req("d", top_k=1, temperature=5.0)])
        assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_top_k_restricts_to_the_k_best():
    logits = logits_for(1, seed=4)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler()
    seen = {sampler.sample(logits, [req(f"x{i}", top_k=3, temperature=2.0)])[0].token_id
            for i in range(200)}
    assert seen == allowed


def test_top_p_keeps_the_smallest_head_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = Sampler()
    seen = {sampler.sample(logits, [req(f"p{i}", top_p=0.8)])[0].token_id for i in range(300)}
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    sampler = Sampler()
    seen = {sampler.sample(logits, [req(f"m{i}", min_p=0.5)])[0].token_id for i in range(300)}
    assert seen == {0, 1}


def test_repetition_penalty_follows_hf_rule():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 7] = 2.0, -1.0, 1.5
    r = Request("r", [1, 2], SamplingParams(temperature=0, repetition_penalty=2.0))
    out = Sampler()._apply_penalties(logits, [r])
    assert out[0, 1] == 1.0 and out[0, 2] == -2.0 and out[0, 7] == 1.5
    assert Sampler().sample(logits, [r])[0].token_id == 7


def test_presence_and_frequency_penalties_apply_to_generated_tokens():
    logits = torch.zeros(1, VOCAB)
    r = Request("r", [5], SamplingParams(temperature=0, presence_penalty=0.5,
                                         frequency_penalty=0.25))
    r.append_output_token(3)
    r.append_output_token(3)
    out = Sampler()._apply_penalties(logits, [r])
    assert out[0, 3] == pytest.approx(-1.0) and out[0, 5] == 0.0


def test_logprobs_of_sampled_and_top_tokens():
    logits = logits_for(1, seed=8)
    out = Sampler().sample(logits, [req("l", temperature=0, logprobs=3)])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert out.logprob is not None
    assert out.logprob.logprob == pytest.approx(float(expected.max()))
    assert [t for t, _ in out.logprob.top] == expected.topk(3).indices.tolist()
    assert math.isclose(sum(math.exp(lp) for _, lp in out.logprob.top),
                        float(expected.exp().topk(3).values.sum()), rel_tol=1e-5)


def test_release_forgets_generators():
    sampler = Sampler()
    sampler.sample(logits_for(1), [req("g", seed=1)])
    sampler.release(["g", "unknown"])
    assert not sampler._generators


def reference_head(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The kept set as a full descending sort defines it (the sampler's rule before it ranked
    a window): the first top_k, cut where the mass before a token reaches top_p."""
    order = logits.double().sort(descending=True).indices
    probs = logits.double().softmax(-1)[order]
    before = probs.cumsum(-1) - probs
    keep = [i for i in range(len(order)) if i < top_k and (i == 0 or before[i] < top_p)]
    return set(order[keep].tolist())


@pytest.mark.parametrize("vocab,top_k,top_p,scale,widens", [
    (5000, 0, 0.9, 3.0, False),      # a head inside the window
    (5000, 0, 0.999, 0.05, True),    # a near-flat row: every token ranked
    (30000, 0, 0.6, 1.0, True),      # a head of ~7k tokens: inside the once-widened window
    (30000, 0, 0.9, 1.0, True),      # ~18k: past that too, every token ranked
    (5000, 2000, 0.999, 0.05, True),  # ... up to top-k
    (5000, 40, 1.0, 1.0, False),     # top-k alone
    (300, 0, 0.5, 2.0, False),       # a row shorter than the window
])
def test_the_kept_head_equals_a_full_sort(vocab, top_k, top_p, scale, widens):
    from kvserve.model.sampler import WINDOW, _kept_head
    for seed in range(5):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
        k = top_k if 0 < top_k < vocab else vocab
        head = _kept_head(logits.numpy(), float(logits.max()), np.float32(1.0), k, top_p)
        assert set(head.tolist()) == reference_head(logits, k, top_p)
        assert (logits[head].diff() <= 0).all()  # best first
        assert (len(head) > WINDOW) == widens


def test_draws_follow_the_probabilities_exactly_on_a_grid_of_uniforms():
    """The inverse CDF: N evenly spaced uniforms give each kept token N * p of the draws (+-1),
    p renormalized over what top-k, top-p and min-p keep."""
    from kvserve.model.sampler import draw
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    n = 10_000
    cases = [  # params, the probabilities the draws must follow
        (SamplingParams(temperature=1.0), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
        (SamplingParams(temperature=1.0, top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0,
                                                      0]),
        (SamplingParams(temperature=1.0, min_p=0.3), [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8, 0, 0,
                                                      0]),
    ]
    for params, expected in cases:
        counts = [0] * 6
        for i in range(n):
            counts[draw(logits.numpy(), params, (i + 0.5) / n)] += 1
        assert all(abs(c - n * p) <= 1 for c, p in zip(counts, expected, strict=True)), \
            (params, counts)
    hot = torch.softmax(logits / 2.0, -1).tolist()  # temperature 2 flattens the row
    counts = [0] * 6
    for i in range(n):
        counts[draw(logits.numpy(), SamplingParams(temperature=2.0), (i + 0.5) / n)] += 1
    assert all(abs(c - n * p) <= 1 for c, p in zip(counts, hot, strict=True)), counts


def test_a_row_with_no_probability_left_is_a_clear_error():
    from kvserve.model.sampler import draw
    masked = torch.full((8,), float("-inf"))
    with pytest.raises(RuntimeError, match="cannot sample"):
        draw(masked.numpy(), SamplingParams(temperature=1.0), 0.5)


def test_draws_over_a_long_row_follow_the_probabilities_across_blocks():
    """Past CDF_BLOCK tokens the CDF is found a block at a time: on a grid of N uniforms every
    token still gets N * p of the draws (+-1), whatever block it is in."""
    from kvserve.model.sampler import CDF_BLOCK, draw
    vocab, n = 3 * CDF_BLOCK + 77, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 2
    probs = torch.softmax(logits.double(), -1)
    counts = torch.zeros(vocab, dtype=torch.long)
    for i in range(n):
        counts[draw(logits.numpy(), SamplingParams(temperature=1.0), (i + 0.5) / n)] += 1
    assert (counts - n * probs).abs().max() <= 1.0 + 1e-6
