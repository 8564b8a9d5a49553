"""Turning a step's logits into tokens: penalties, grammar masks, temperature,
top-k/top-p/min-p, seeds, logprobs.

Every request samples from its own `torch.Generator`, seeded from its `seed` when it has one, so
a seeded request draws the same tokens whatever else shares its batch: one uniform a token,
mapped through the inverse CDF of what the filters keep (`draw`).

The rows are read as numpy arrays: over a 49k vocabulary torch's CPU argmax, sort and
multinomial cost 0.1, 4 and 1.3 ms a row where numpy's argmax, a partition of the best 1,024
tokens and one cumulative sum cost a few hundredths to a few tenths (docs/benchmarks.md,
"Sampling cost per token").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvserve.engine import Request, SampledToken, SamplingParams, TokenLogprob
from kvserve.model.grammar import GrammarMasks


class Sampler:
    """Samples one token per row of logits; keeps each live request's generator."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 grammar_masks: GrammarMasks | None = None) -> None:
        self.device = torch.device(device)
        self.grammar_masks = grammar_masks  # None: requests with a constraint are refused
        self._seed_source = torch.Generator(device="cpu").manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the generators of requests that ended."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self.grammar_masks is not None:
            self.grammar_masks.release(request_ids)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampledToken]:
        """`logits`: [num_requests, vocab] (float32), row i for `requests[i]`."""
        # Invariant: row i's token depends only on row i's logits, params and generator.
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_requests, vocab]
        logits = self._apply_penalties(logits, requests)
        if self.grammar_masks is not None:
            self.grammar_masks.apply(logits, requests)  # greedy and random rows alike
        rows = logits.detach().to("cpu").numpy()  # [num_requests, vocab] float32, no copy on CPU
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        tokens = [0] * len(requests)
        if greedy:  # the first of equal maxima, as torch.argmax (a NaN counts as the maximum)
            best = rows.argmax(axis=-1) if len(greedy) == len(requests) else \
                rows[greedy].argmax(axis=-1)
            for i, token in zip(greedy, best.tolist(), strict=True):
                tokens[i] = token
        for i, request in enumerate(requests):
            if not request.sampling_params.is_greedy:
                gen = self._generator(request)
                uniform = float(torch.rand((), generator=gen, device=gen.device,
                                           dtype=torch.float64))
                tokens[i] = draw(rows[i], request.sampling_params, uniform)

        out = []
        for i, request in enumerate(requests):
            logprob = None
            k = request.sampling_params.logprobs
            if k is not None and raw_logprobs is not None:
                row = raw_logprobs[i]
                top = []
                if k > 0:
                    values, ids = row.topk(k)
                    top = list(zip(ids.tolist(), values.tolist(), strict=True))
                logprob = TokenLogprob(tokens[i], float(row[tokens[i]]), tuple(top))
            out.append(SampledToken(tokens[i], logprob))
        return out

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            params, request = requests[i].sampling_params, requests[i]
            row = logits[i]  # [vocab], a view
            if params.repetition_penalty != 1.0:
                # HF's rule over prompt and output: shrink positive logits, grow negative ones.
                seen = torch.tensor(sorted(set(request.all_token_ids)), device=row.device)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            if request.output_token_ids and (params.presence_penalty or params.frequency_penalty):
                # OpenAI's rule over the generated tokens only.
                out = torch.tensor(request.output_token_ids, device=row.device)
                counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
                row -= params.frequency_penalty * counts
                row -= params.presence_penalty * (counts > 0).to(row.dtype)
        return logits


WINDOW = 1024  # tokens ranked first for top-p (a partition: one pass, then a small sort)
GROWTH = 8  # a head that fills the window is ranked again in one GROWTH times wider
CDF_BLOCK = 1024  # weights summed a block at a time before the draw's running sum
TOP_P_SLACK = 1e-6  # a head's mass this close to top_p reaches it (float32 rounding of sums)


def draw(logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
    """One token from logits [vocab] (float32) under temperature, top-k, top-p and min-p, by
    the inverse CDF at `uniform` in [0, 1): top-k keeps the k best; top-p the smallest head
    whose mass (of the whole row's softmax) reaches top_p, the first token always; min-p then
    drops the tokens under min_p times the best one's probability; the rest are drawn in
    proportion to their probabilities. Whole-row passes stay in float32 (numpy's float64 exp
    is several times slower); sums are float64. RuntimeError where no token has a
    probability (NaN, +inf, or all -inf)."""
    top = float(logits.max())
    if not math.isfinite(top):
        raise RuntimeError("cannot sample: the logits hold NaN or +inf, or every token is -inf "
                           "after penalties and grammar masks")
    vocab = logits.shape[0]
    inv_t = np.float32(1.0 / params.temperature)
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    ids = None
    if top_k < vocab or params.top_p < 1.0:
        ids = _kept_head(logits, top, inv_t, top_k, params.top_p)  # best first
        weights = np.exp((logits[ids] - logits[ids[0]]) * inv_t)
    else:
        weights = _scaled_exp(logits, top, inv_t)
    if params.min_p > 0.0:
        weights[weights < np.float32(params.min_p) * weights.max()] = 0.0
    j = _inverse_cdf(weights, uniform)
    return int(ids[j]) if ids is not None else j


def _scaled_exp(logits: np.ndarray, top: float, inv_t: np.float32) -> np.ndarray:
    """exp((logits - top) / temperature), float32, computed in one new array."""
    out = logits - np.float32(top)
    out *= inv_t
    return np.exp(out, out=out)


def _kept_head(logits: np.ndarray, top: float, inv_t: np.float32, top_k: int,
               top_p: float) -> np.ndarray:
    """Token ids kept by top-k and top-p (`top`: the row's largest logit), best first (equal
    logits in no set order, as after a sort). Ranks only the best WINDOW tokens, by a
    partition, when the head ends inside them; else GROWTH times as many, and so on up to
    every token top-k allows (a whole 49k row takes a few ms to sort)."""
    vocab = logits.shape[0]
    width = top_k if top_p >= 1.0 else min(top_k, WINDOW)
    exp = _scaled_exp(logits, top, inv_t) if top_p < 1.0 else None
    total = exp.sum(dtype=np.float64) if exp is not None else 0.0
    while True:
        part = (np.argpartition(logits, vocab - width)[vocab - width:] if width < vocab
                else np.arange(vocab))
        ids = part[np.argsort(-logits[part])]
        if exp is None:
            return ids
        mass = exp[ids].astype(np.float64) / total
        before = np.cumsum(mass) - mass  # the row's mass ahead of each token
        keep = max(1, int(np.searchsorted(before, top_p - TOP_P_SLACK, side="left")))
        if keep < width or width == top_k:
            return ids[:keep]
        width = min(top_k, width * GROWTH)  # the head may go past the window: widen it


def _inverse_cdf(weights: np.ndarray, uniform: float) -> int:
    """The first index whose running sum of weights (>= 0, a positive total) passes uniform
    times the total: a draw in proportion to the weights. Sums blocks of CDF_BLOCK first, then
    runs through the one block the target falls in (a whole-row float64 running sum costs a
    few times more)."""
    n, start = len(weights), 0
    if n <= CDF_BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        target = uniform * cdf[-1]
    else:
        full = n - n % CDF_BLOCK
        sums = weights[:full].reshape(-1, CDF_BLOCK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, weights[full:].sum(dtype=np.float64))
        cum = np.cumsum(sums)
        target = uniform * cum[-1]
        b = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
        start = b * CDF_BLOCK
        target -= cum[b - 1] if b else 0.0
        cdf = np.cumsum(weights[start:start + CDF_BLOCK], dtype=np.float64)
    j = int(np.searchsorted(cdf, target, side="right"))
    if j >= len(cdf):  # the target rounded up to the block's total: its last weighted token
        j = int(np.flatnonzero(weights[start:start + len(cdf)])[-1])
    return start + j
