"""Turning a step's logits into tokens: penalties, grammar masks, temperature,
top-k/top-p/min-p, seeds, logprobs.

Every request samples from its own `torch.Generator`, seeded from its `seed` when it has one, so
a seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)

        greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        if greedy and len(greedy) == len(requests):  # all greedy: no copy of the rows
            token_ids = logits.argmax(dim=-1)
        elif greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        random = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random:
            probs = self._filtered_probs(logits[random], [requests[i].sampling_params
                                                           for i in random])
            for row, i in enumerate(random):
                gen = self._generator(requests[i])
                token_ids[i] = torch.multinomial(probs[row], 1, generator=gen)[0]

        tokens = token_ids.tolist()
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

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p; [rows, vocab]."""
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature.unsqueeze(1)
        vocab = logits.shape[1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                             device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            drop = ranks >= top_k.unsqueeze(1)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if bool((min_p > 0).any()):
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs
