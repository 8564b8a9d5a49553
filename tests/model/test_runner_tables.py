"""The runner's block-table tensor: rows of any length, padded with block 0, int32."""

from __future__ import annotations

import torch

from kvserve.model.runner import _padded_tables


def test_rows_are_padded_with_block_zero():
    tables = [(7, 3, 9), (4,), [11, 12, 13, 14, 2**31 - 1]]
    got = _padded_tables(tables, torch.device("cpu"))
    assert got.dtype == torch.int32
    assert got.tolist() == [[7, 3, 9, 0, 0], [4, 0, 0, 0, 0], [11, 12, 13, 14, 2**31 - 1]]
