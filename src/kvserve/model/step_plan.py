"""StepPlan: one scheduled step flattened to plain data, the same on every tensor-parallel rank.

Rank 0 builds it from the scheduler's output; the other ranks receive it (it pickles small:
ints and tuples only, no request objects) and run the identical forward pass. `checksum`
covers the block tables and the slot mapping, so a rank can prove it executes the KV layout
rank 0 decided, and `step_id` that it executes the step rank 0 sent.
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Row r of the flattened batch is token `positions[r]` of its sequence; its K/V goes to
    `slot_mapping[r]`. Sequence i owns rows `query_start[i]:query_start[i + 1]`, has context
    `seq_lens[i]` (this step's tokens included) and reads it through `block_tables[i]`.
    `sample_rows`: the rows whose logits are sampled (one per finishing chunk, in order)."""

    step_id: int
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    query_start: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    sample_rows: tuple[int, ...]
    checksum: int

    @classmethod
    def from_output(cls, output: SchedulerOutput, block_size: int, step_id: int, *,
                    with_checksum: bool = True) -> StepPlan:
        """Flatten the scheduled items in order (prefill chunks and decodes together);
        `with_checksum=False` (one rank: nobody to check against) leaves `checksum` 0."""
        # Plain Python lists: per-step overhead stays small next to the model for decode-heavy
        # batches of many short queries.
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for item in output.scheduled:
            start, end = item.start, item.start + item.num_new_tokens
            table = item.block_table
            input_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            query_start.append(len(input_ids))
            seq_lens.append(end)
            if item.sample:
                sample_rows.append(len(input_ids) - 1)
        tables = tuple(tuple(item.block_table) for item in output.scheduled)
        return cls(step_id, tuple(input_ids), tuple(positions), tuple(slots),
                   tuple(query_start), tuple(seq_lens), tables, tuple(sample_rows),
                   layout_checksum(tables, slots) if with_checksum else 0)

    def verify_checksum(self) -> bool:
        """Whether the block tables and slot mapping held here are the ones checksummed."""
        return layout_checksum(self.block_tables, self.slot_mapping) == self.checksum


def layout_checksum(block_tables: Sequence[Sequence[int]], slot_mapping: Sequence[int]) -> int:
    """CRC32 of the block tables (each with its length) and the slot mapping."""
    crc = 0
    for table in block_tables:
        crc = zlib.crc32(array.array("q", [len(table), *table]).tobytes(), crc)
    return zlib.crc32(array.array("q", slot_mapping).tobytes(), crc)
