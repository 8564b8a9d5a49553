"""The model runner: one scheduled step in, one sampled token per finishing chunk out.

It implements the engine's `ModelExecutor`: flattens the step's tokens (prefill chunks and
decodes together), builds the attention metadata from the block tables the scheduler verified,
runs the network over the paged KV cache and samples the rows whose chunk reaches the end of its
sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvserve.engine import SampledToken, SchedulerOutput
from kvserve.model.attention_metadata import AttentionMetadata, compute_positions
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.paged_attention import KVCache
from kvserve.model.sampler import Sampler


class ModelRunner:
    """Runs `model` over `kv_caches` (one per layer) for the engine, on the model's device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[KVCache],
        block_size: int,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.sampler = sampler
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        # Invariant: row r of the flattened batch is token `start + j` of its sequence, and its
        # K/V lands in the slot its block table names for that position.
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        sample_rows: list[int] = []
        sample_requests = []
        for item in output.scheduled:
            input_ids.extend(item.token_ids)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(item.start + item.num_new_tokens)
            tables.append(item.block_table)
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(item.request)
        meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, self.block_size,
                                            self.device)
        positions = compute_positions(query_lens, seq_lens, self.device)  # [num_tokens]
        tokens = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [num_tokens]
        hidden = self.model(tokens, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        if not sample_rows:
            return {}
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [num_samples, vocab]
        sampled = self.sampler.sample(logits, sample_requests)
        return {r.request_id: s for r, s in zip(sample_requests, sampled, strict=True)}

    def release(self, request_ids: Iterable[str]) -> None:
        self.sampler.release(list(request_ids))
