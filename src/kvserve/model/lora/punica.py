"""Batched low-rank products for many adapters in one step (Punica / S-LoRA's BGMV and SGMV).

Every loaded adapter sits in a fixed slot of stacked tensors: `a` [num_slots, n * R, in] (the n
sub-modules' A matrices of one fused projection stacked along the rank, each zero-padded to R =
max_lora_rank) and one `b` [num_slots, out_m, R] per sub-module. A row of the batch either
belongs to an adapter's slot or to the base model (slot -1: no delta).

- `sgmv_add`: the adapter rows gathered once, ordered by slot (segments), then per segment a
  shrink x[rows] @ a[slot].T and an expand of each sub-module's rank block @ b[slot].T, and one
  scatter-add per sub-module. Work is proportional to the rows that have adapters; this is what
  the model runs.
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
class Segments:
    """The rows of one step that run adapters, ordered by slot: `rows` (a slice when they are
    contiguous, else an index tensor [n], int64) lists them; `spans` are (slot, start, stop)
    ranges of that order. Rows of the base model are in neither."""

    rows: slice | torch.Tensor
    spans: tuple[tuple[int, int, int], ...]

    @property
    def slots(self) -> frozenset[int]:
        return frozenset(slot for slot, _, _ in self.spans)


def sgmv_add(x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
             outs: Sequence[torch.Tensor], segments: Segments, rank: int) -> None:
    """outs[m][row] += (x[row] @ a[slot].T)[m*R:(m+1)*R] @ bs[m][slot].T for every row of every
    span. x [T, in]; a [S, n*R, in]; bs[m] [S, out_m, R]; outs[m] [T, out_m]."""
    # Invariant: rows of no span (the base model's) are left exactly as the base matmul made them.
    xs = x[segments.rows]  # [n, in], ordered by slot
    shrunk = xs.new_empty(xs.shape[0], a.shape[1])  # [n, n_sub * R]
    for slot, start, stop in segments.spans:
        torch.matmul(xs[start:stop], a[slot].T, out=shrunk[start:stop])
    for m, (b, out) in enumerate(zip(bs, outs, strict=True)):
        delta = xs.new_empty(xs.shape[0], b.shape[1])  # [n, out_m]
        for slot, start, stop in segments.spans:
            torch.matmul(shrunk[start:stop, m * rank : (m + 1) * rank], b[slot].T,
                         out=delta[start:stop])
        if isinstance(segments.rows, slice):
            out[segments.rows] += delta
        else:
            out.index_add_(0, segments.rows, delta)


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


def slot_segments(seq_slots: Sequence[int], query_start: Sequence[int],
                  device: torch.device) -> Segments:
    """Order the rows of the sequences that run adapters by slot (sequence i owns rows
    `query_start[i]:query_start[i + 1]`; slot -1: the base model, left out)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for i, slot in enumerate(seq_slots):
        if slot >= 0 and query_start[i + 1] > query_start[i]:
            ranges.setdefault(slot, []).append((query_start[i], query_start[i + 1]))
    spans, pieces, offset = [], [], 0
    for slot, parts in ranges.items():
        size = sum(stop - start for start, stop in parts)
        spans.append((slot, offset, offset + size))
        pieces.extend(parts)
        offset += size
    contiguous = all(pieces[i][1] == pieces[i + 1][0] for i in range(len(pieces) - 1))
    if not pieces:
        return Segments(slice(0, 0), ())
    if contiguous:
        return Segments(slice(pieces[0][0], pieces[-1][1]), tuple(spans))
    rows = torch.cat([torch.arange(start, stop) for start, stop in pieces]).to(device)  # [n]
    return Segments(rows, tuple(spans))
