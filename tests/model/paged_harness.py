"""A minimal stand-in for the runner: block bookkeeping plus one forward per step.

Blocks are handed out from a shuffled free list (so block tables are never contiguous), freed
blocks are reused first, and caches may start full of finite junk, so any read of a slot the
contract says is unused shows up as a wrong logit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kvserve.model import AttentionMetadata, LlamaForCausalLM, allocate_kv_caches, compute_positions


class PagedRunner:
    """Runs steps of many sequences over one paged cache; returns every new row's logits."""

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int = 64, block_size: int = 4,
                 seed: int = 0, junk: bool = True, kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the caches' dtype (the model's when None)."""
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.caches = allocate_kv_caches(model.config, num_blocks, block_size,
                                         dtype=kv_dtype or param.dtype, device=param.device)
        if junk:
            gen = torch.Generator().manual_seed(seed)
            for cache in self.caches:
                for t in (cache.key_cache, cache.value_cache):
                    t.copy_(100 * torch.randn(t.shape, generator=gen))
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.seq_lens: dict[str, int] = {}
        self.num_shared: dict[str, int] = {}  # leading blocks a sequence borrows from another

    def share_prefix(self, source: str, seq_id: str, num_blocks: int) -> None:
        """Start `seq_id` on `source`'s first `num_blocks` (full) blocks, as a prefix-cache hit
        does: the blocks are shared, not copied, and their tokens count as computed. `source`
        must stay alive while `seq_id` runs."""
        assert self.seq_lens[source] >= num_blocks * self.block_size, "only full blocks"
        self.block_tables[seq_id] = self.block_tables[source][:num_blocks]
        self.seq_lens[seq_id] = num_blocks * self.block_size
        self.num_shared[seq_id] = num_blocks

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Feed each (seq_id, new_token_ids) in order; returns seq_id -> logits [q_len, vocab]."""
        query_lens, seq_lens, tables, input_ids = [], [], [], []
        for seq_id, tokens in chunks:
            new_len = self.seq_lens.get(seq_id, 0) + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < new_len:
                table.append(self.free_blocks.pop())
            self.seq_lens[seq_id] = new_len
            query_lens.append(len(tokens))
            seq_lens.append(new_len)
            tables.append(list(table))
            input_ids.extend(tokens)
        device = self.caches[0].key_cache.device
        metadata = AttentionMetadata.from_lists(query_lens, seq_lens, tables, self.block_size,
                                                device)
        positions = compute_positions(query_lens, seq_lens, device)
        with torch.no_grad():
            hidden = self.model(torch.tensor(input_ids, device=device), positions, self.caches,
                                metadata)
            logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for (seq_id, _), n in zip(chunks, query_lens, strict=True):
            out[seq_id] = logits[row:row + n]
            row += n
        return out

    def free(self, seq_id: str) -> None:
        """Return the sequence's blocks; they are the next ones handed out (dirty)."""
        own = self.block_tables.pop(seq_id)[self.num_shared.pop(seq_id, 0):]
        self.free_blocks.extend(reversed(own))
        del self.seq_lens[seq_id]
