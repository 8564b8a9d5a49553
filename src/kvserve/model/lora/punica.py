"""Batched low-rank products for many adapters in one step (Punica / S-LoRA's BGMV and SGMV).

Every loaded adapter sits in a fixed slot of stacked tensors: `a` [num_slots, n * R, in] (the n
sub-modules' A matrices of one fused projection stacked along the rank, each zero-padded to R =
max_lora_rank) and one `b` [num_slots, out_m, R] per sub-module. A row of the batch either
belongs to an adapter's slot or to the base model (slot -1: no delta).

- `sgmv_add`: rows grouped by slot (a sequence's rows are contiguous), two matmuls per slot
  present: shrink x[rows] @ a[slot].T, then expand each sub-module's rank block @ b[slot].T.
  Work is proportional to the rows that have adapters; this is what the model runs.
- `bgmv_add`: the per-token gather (every row gathers its own A and B), the reference that
  `sgmv_add` is checked against; it materialises [rows, R, in] and is slower on CPUs
  (docs/benchmarks.md, LoRA).

Both add the deltas in place into `outs` (views of the base projection's output slices), so
they work after any base matmul: dense, fused or oneDNN-packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SlotGroup:
    """The rows of one step that use adapter slot `slot`: a slice when contiguous, else an
    index tensor [n] (int64)."""

    slot: int
    rows: slice | torch.Tensor


def sgmv_add(x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
             outs: Sequence[torch.Tensor], groups: Sequence[SlotGroup], rank: int) -> None:
    """outs[m][rows] += (x[rows] @ a[slot].T)[:, m*R:(m+1)*R] @ bs[m][slot].T, per group.
    x [T, in]; a [S, n*R, in]; bs[m] [S, out_m, R]; outs[m] [T, out_m]."""
    # Invariant: rows of no group (the base model's) are left exactly as the base matmul made them.
    for group in groups:
        xs = x[group.rows]  # [n_rows, in]
        shrunk = xs @ a[group.slot].T  # [n_rows, n * R]
        for m, (b, out) in enumerate(zip(bs, outs, strict=True)):
            delta = shrunk[:, m * rank : (m + 1) * rank] @ b[group.slot].T  # [n_rows, out_m]
            if isinstance(group.rows, slice):
                out[group.rows] += delta
            else:
                out.index_add_(0, group.rows, delta)


def bgmv_add(x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
             outs: Sequence[torch.Tensor], token_slots: torch.Tensor, rank: int) -> None:
    """The same sums with every row gathering its own slot: token_slots [T] (int64, -1 for the
    base model)."""
    mask = (token_slots >= 0).to(x.dtype)[:, None]  # [T, 1]
    idx = token_slots.clamp(min=0)  # [T]
    shrunk = torch.bmm(a[idx], x[:, :, None])[:, :, 0]  # [T, n * R]
    for m, (b, out) in enumerate(zip(bs, outs, strict=True)):
        part = shrunk[:, m * rank : (m + 1) * rank, None]  # [T, R, 1]
        out += torch.bmm(b[idx], part)[:, :, 0] * mask  # [T, out_m]


def slot_groups(seq_slots: Sequence[int], query_start: Sequence[int],
                device: torch.device) -> list[SlotGroup]:
    """Group the rows of sequences by adapter slot (sequence i owns rows
    `query_start[i]:query_start[i + 1]`; slot -1: the base model, no group)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for i, slot in enumerate(seq_slots):
        if slot >= 0 and query_start[i + 1] > query_start[i]:
            ranges.setdefault(slot, []).append((query_start[i], query_start[i + 1]))
    groups = []
    for slot, spans in ranges.items():
        merged: list[tuple[int, int]] = []
        for start, stop in spans:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        if len(merged) == 1:
            groups.append(SlotGroup(slot, slice(*merged[0])))
        else:
            rows = torch.cat([torch.arange(s, e) for s, e in merged]).to(device)  # [n]
            groups.append(SlotGroup(slot, rows))
    return groups
