"""A toy model over paged memory, for exact tests of the scheduler/cache seam without torch.

Its "KV" for a token is (token id, position), written to the slot the block table names. The
next token is a function of the context *read back through the block table*, so a block shared,
evicted or reassigned wrongly changes the output, exactly as it would corrupt a real model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.engine import SampledToken, SchedulerOutput

VOCAB = 50


def next_token(context: Sequence[int]) -> int:
    """The toy model's greedy choice given the whole context."""
    tail = context[-8:]
    return (sum((i + 3) * t for i, t in enumerate(tail)) + 7 * len(context)) % VOCAB


def reference_generate(prompt: Sequence[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """What any correct engine must produce: no cache, no batching."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token(tokens)
        out.append(tok)
        tokens.append(tok)
        if tok == eos:
            break
    return out


class PagedToyModel:
    """Implements `ModelExecutor` over `num_blocks * block_size` slots, and host and disk tiers
    of `num_host_slots` and `num_disk_slots` blocks that the step's copies move KV to and from
    (demotions, then offloads, then loads)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_slots: int = 0,
                 num_disk_slots: int = 0) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.host: list[list[tuple[int, int] | None]] = [[None] * block_size
                                                         for _ in range(num_host_slots)]
        self.disk: list[list[tuple[int, int] | None]] = [[None] * block_size
                                                         for _ in range(num_disk_slots)]
        self.fail_next = False  # the next step raises before it runs anything
        self.num_steps = 0
        self.tokens_computed = 0
        self.released: list[str] = []

    def slot(self, block_table: Sequence[int], position: int) -> int:
        bs = self.block_size
        return block_table[position // bs] * bs + position % bs

    def release(self, request_ids: Iterable[str]) -> None:
        self.released.extend(request_ids)

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the device fell over")
        self.num_steps += 1
        bs = self.block_size
        for demotion in output.kv_transfers.demotions:
            self.disk[demotion.disk_slot] = list(self.host[demotion.host_slot])
        for offload in output.kv_transfers.offloads:
            start = offload.block_id * bs
            self.host[offload.host_slot] = self.slots[start : start + bs]
        for load in output.kv_transfers.loads:
            start = load.block_id * bs
            self.slots[start : start + bs] = self.host[load.host_slot]
        for disk_load in output.kv_transfers.disk_loads:
            start = disk_load.block_id * bs
            self.slots[start : start + bs] = self.disk[disk_load.disk_slot]
        # Like a real model's layers: the whole step's KV is written before any token reads.
        for item in output.scheduled:
            for j, token in enumerate(item.token_ids):
                self.slots[self.slot(item.block_table, item.start + j)] = (token, item.start + j)
            self.tokens_computed += item.num_new_tokens
        sampled = {}
        for item in output.scheduled:
            if item.sample:
                context = []
                for pos in range(item.start + item.num_new_tokens):
                    entry = self.slots[self.slot(item.block_table, pos)]
                    assert entry is not None and entry[1] == pos, f"bad KV at position {pos}"
                    context.append(entry[0])
                sampled[item.request.request_id] = SampledToken(next_token(context))
        return sampled


class CharDecoder:
    """Token id t decodes to chr(ord('a') + t % 26); ids >= 26 are upper case."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr((ord("a") if t < 26 else ord("A")) + t % 26) for t in token_ids)
