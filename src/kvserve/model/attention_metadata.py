"""AttentionMetadata: where one step's tokens sit in their sequences and in the paged KV cache.

Built once per step by the runner (``from_lists`` does it from plain Python lists) and read by
every layer's attention. Vocabulary follows vLLM: ``query_start_loc``, ``seq_lens``,
``block_tables``, ``slot_mapping``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIN_CASCADE_BLOCKS = 4  # a shared head shorter than this is cheaper to gather per sequence


@dataclass(frozen=True, slots=True)
class PrefillCascade:
    """Prefill chunks (two or more) whose block tables start with the same `head_len // bs`
    blocks, all inside every member's cached context: cascade_attention reads them once.

    Per member, in `seq_idx` order: its rows start at `query_starts`, `query_lens` long; its
    cached context is `context_starts` tokens (>= head_len), its whole context `seq_lens`.
    """

    seq_idx: tuple[int, ...]
    rows: torch.Tensor  # [sum(query_lens)] int64, the members' rows of the flattened batch
    head_block_ids: torch.Tensor  # [head_len // block_size] int64
    head_len: int
    query_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_starts: tuple[int, ...]
    seq_lens: tuple[int, ...]
    tail_block_ids: tuple[torch.Tensor, ...]  # per member: its blocks after the head


@dataclass(slots=True)
class DecodeBatch:
    """The step's decode sequences (query_len == 1), gathered once and shared by all layers."""

    token_idx: torch.Tensor  # [num_decodes] int64, rows of the flattened batch
    block_tables: torch.Tensor  # [num_decodes, max_blocks_per_seq] int64, padding clamped to >= 0
    seq_lens: torch.Tensor  # [num_decodes] int64
    max_seq_len: int
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Padded context slots each decode may see (cached per window). [num_decodes, max_len]."""
        if sliding_window not in self._masks:
            k_pos = torch.arange(self.max_seq_len, device=self.seq_lens.device)[None, :]
            mask = k_pos < self.seq_lens[:, None]  # [num_decodes, max_seq_len]
            if sliding_window is not None:
                mask &= k_pos > (self.seq_lens[:, None] - 1) - sliding_window
            self._masks[sliding_window] = mask
        return self._masks[sliding_window]


@dataclass(slots=True)
class DecodeCascade:
    """Every decode of the step starts its block table with the same `head_len // bs` blocks
    (a shared prompt head), and each decode's new token lies after them, so every decode's
    tail (its blocks after the head, padded to `tail_len` tokens) holds >= 1 visible token.

    Planned once per step (AttentionMetadata.decode_cascade) and read by every layer; never
    touches the KV cache.
    """

    head_block_ids: torch.Tensor  # [head_len // block_size] int64
    tail_block_ids: torch.Tensor  # [num_decodes * tail_len // block_size] int64, by decode
    tail_lens: torch.Tensor  # [num_decodes] int64, visible tail tokens (1..tail_len)
    head_len: int
    tail_len: int
    _biases: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def tail_bias(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """Additive mask (0 or -inf, float32) over each decode's tail keys taken position-major
        ([tail_len, num_kv_heads] flattened): query head h sees key (pos, kv) iff kv is h's kv
        head and pos < tail_lens. [num_decodes, num_heads, tail_len * num_kv_heads], cached."""
        key = (num_heads, num_kv_heads)
        if key not in self._biases:
            device, hidden = self.tail_lens.device, float("-inf")
            pos = torch.arange(self.tail_len, device=device)
            by_pos = torch.where(pos < self.tail_lens[:, None], 0.0, hidden)  # [D, tail_len]
            kv_of_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
            by_head = torch.where(kv_of_head[:, None] == torch.arange(num_kv_heads, device=device),
                                  0.0, hidden)  # [H, KVH]
            bias = by_pos[:, None, :, None] + by_head[None, :, None, :]  # [D, H, tail_len, KVH]
            self._biases[key] = bias.flatten(2)
        return self._biases[key]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of a flattened batch over the paged KV cache.

    Sequence i's new tokens are rows ``query_start_loc[i]:query_start_loc[i+1]``; ``seq_lens[i]``
    counts its context INCLUDING them; ``block_tables[i]`` lists its blocks in position order
    (padded, padding never read unmasked); new token t's K/V goes to slot ``slot_mapping[t]``.
    The ``*_cpu`` copies avoid device syncs; when omitted they are read back once from the tensors.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths from 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    query_start_cpu: tuple[int, ...] = ()  # host copy of query_start_loc
    seq_lens_cpu: tuple[int, ...] = ()  # host copy of seq_lens
    block_tables_cpu: Sequence[Sequence[int]] = ()  # host copy of block_tables (rows may be
    # shorter than the tensor's: padding is never read)
    prefill_seq_idx: tuple[int, ...] = field(init=False)  # sequences with query_len > 1
    decode_seq_idx: tuple[int, ...] = field(init=False)  # sequences with query_len == 1
    _decode: DecodeBatch | None = field(init=False, default=None)
    _cascades: tuple[PrefillCascade, ...] | None = field(init=False, default=None)
    _decode_cascade: tuple[DecodeCascade | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.query_start_cpu:
            self.query_start_cpu = tuple(self.query_start_loc.tolist())
        if not self.seq_lens_cpu:
            self.seq_lens_cpu = tuple(self.seq_lens.tolist())
        starts = self.query_start_cpu
        query_lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
        self.prefill_seq_idx = tuple(i for i, n in enumerate(query_lens) if n > 1)
        self.decode_seq_idx = tuple(i for i, n in enumerate(query_lens) if n == 1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_cpu[-1]

    def decode_batch(self) -> DecodeBatch | None:
        """The decode sequences as one batch (built on first call), or None if there are none."""
        if self._decode is None and self.decode_seq_idx:
            device = self.block_tables.device
            rows = torch.tensor(self.decode_seq_idx, dtype=torch.int64, device=device)
            self._decode = DecodeBatch(
                token_idx=torch.tensor([self.query_start_cpu[i] for i in self.decode_seq_idx],
                                       dtype=torch.int64, device=device),
                block_tables=self.block_tables.index_select(0, rows).to(torch.int64).clamp_(min=0),
                seq_lens=torch.tensor([self.seq_lens_cpu[i] for i in self.decode_seq_idx],
                                      dtype=torch.int64, device=device),
                max_seq_len=max(self.seq_lens_cpu[i] for i in self.decode_seq_idx),
            )
        return self._decode

    def decode_cascade(self, block_size: int) -> DecodeCascade | None:
        """The decodes' shared head of at least MIN_CASCADE_BLOCKS blocks (planned on first
        call from the host copies), or None when fewer than two decodes share one."""
        if self._decode_cascade is None:
            self._decode_cascade = (self._plan_decode_cascade(block_size),)
        return self._decode_cascade[0]

    def _plan_decode_cascade(self, block_size: int) -> DecodeCascade | None:
        rows = self.decode_seq_idx
        if len(rows) < 2:
            return None
        # The head ends before every decode's own new token (at seq_len - 1): no tail is empty.
        num_head = (min(self.seq_lens_cpu[i] for i in rows) - 1) // block_size
        if num_head < MIN_CASCADE_BLOCKS:
            return None
        tables = self.block_tables_cpu or self.block_tables.tolist()
        first = tables[rows[0]]
        head = first[:num_head]
        for i in rows[1:]:
            if tables[i][:num_head] != head:  # (also for a list against a tuple: then exact)
                num_head = next((j for j in range(num_head) if tables[i][j] != first[j]),
                                num_head)
                if num_head < MIN_CASCADE_BLOCKS:
                    return None
                head = first[:num_head]
        batch = self.decode_batch()
        assert batch is not None
        num_blocks = -(-batch.max_seq_len // block_size)
        head_len = num_head * block_size
        return DecodeCascade(
            head_block_ids=batch.block_tables[0, :num_head],
            tail_block_ids=batch.block_tables[:, num_head:num_blocks].reshape(-1),
            tail_lens=batch.seq_lens - head_len,
            head_len=head_len,
            tail_len=(num_blocks - num_head) * block_size,
        )

    def prefill_cascades(self, block_size: int) -> tuple[PrefillCascade, ...]:
        """Groups of prefill chunks that share a head of at least MIN_CASCADE_BLOCKS cached
        blocks (planned on first call; chunks with no shared head are in none)."""
        if self._cascades is None:
            self._cascades = self._plan_cascades(block_size)
        return self._cascades

    def _plan_cascades(self, block_size: int) -> tuple[PrefillCascade, ...]:
        starts, lens = self.query_start_cpu, self.seq_lens_cpu
        if len(self.prefill_seq_idx) < 2:
            return ()
        tables = self.block_tables_cpu or self.block_tables.tolist()
        by_first_block: dict[int, list[int]] = {}
        for i in self.prefill_seq_idx:
            context = lens[i] - (starts[i + 1] - starts[i])
            if context >= MIN_CASCADE_BLOCKS * block_size:
                by_first_block.setdefault(tables[i][0], []).append(i)
        plans = []
        device = self.block_tables.device
        for members in by_first_block.values():
            if len(members) < 2:
                continue
            first = tables[members[0]]
            num_head = min((lens[i] - (starts[i + 1] - starts[i])) // block_size
                           for i in members)
            for i in members[1:]:
                table = tables[i]
                same = 0
                while same < num_head and table[same] == first[same]:
                    same += 1
                num_head = same
            if num_head < MIN_CASCADE_BLOCKS:
                continue
            rows = [r for i in members for r in range(starts[i], starts[i + 1])]
            plans.append(PrefillCascade(
                seq_idx=tuple(members),
                rows=torch.tensor(rows, dtype=torch.int64, device=device),
                head_block_ids=torch.tensor(first[:num_head], dtype=torch.int64, device=device),
                head_len=num_head * block_size,
                query_starts=tuple(starts[i] for i in members),
                query_lens=tuple(starts[i + 1] - starts[i] for i in members),
                context_starts=tuple(lens[i] - (starts[i + 1] - starts[i]) for i in members),
                seq_lens=tuple(lens[i] for i in members),
                tail_block_ids=tuple(self.block_tables[i, num_head:-(-lens[i] // block_size)]
                                     for i in members),
            ))
        return tuple(plans)

    @classmethod
    def from_lists(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
                   block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
        """Build a step from per-sequence lists; slot_mapping is derived from the block tables.

        Raises ValueError when a query is empty or longer than its context, or a block table is
        too short for its context.
        """
        _check_lists(query_lens, seq_lens, block_tables, block_size)
        positions, seq_of_token = _positions(query_lens, seq_lens)  # [num_tokens] each
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        block_ids = tables[seq_of_token, positions // block_size].to(torch.int64)  # [num_tokens]
        slot_mapping = block_ids * block_size + positions % block_size  # [num_tokens]
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        return cls(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=slot_mapping.to(device),
            query_start_cpu=tuple(query_start),
            seq_lens_cpu=tuple(seq_lens),
            block_tables_cpu=[list(t) for t in block_tables],
        )


def compute_positions(query_lens: Sequence[int], seq_lens: Sequence[int],
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Absolute position of every new token: seq_len - query_len + j. Returns [num_tokens] int64."""
    return _positions(query_lens, seq_lens)[0].to(device)


def _positions(query_lens: Sequence[int],
               seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    q_lens = torch.tensor(list(query_lens), dtype=torch.int64)  # [num_seqs]
    s_lens = torch.tensor(list(seq_lens), dtype=torch.int64)  # [num_seqs]
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [num_tokens]
    first_row = torch.cumsum(q_lens, 0) - q_lens  # [num_seqs]
    offset = torch.arange(int(q_lens.sum())) - first_row[seq_of_token]  # [num_tokens]
    return (s_lens - q_lens)[seq_of_token] + offset, seq_of_token


def _check_lists(query_lens: Sequence[int], seq_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], block_size: int) -> None:
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and "
                         f"block_tables ({len(block_tables)}) must have one entry per sequence")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, block_tables,
                                                  strict=True)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"sequence {i}: need 1 <= query_len ({q_len}) <= seq_len ({s_len})")
        if len(table) * block_size < s_len:
            raise ValueError(f"sequence {i}: {len(table)} blocks of {block_size} cannot hold "
                             f"{s_len} tokens")
