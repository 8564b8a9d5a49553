"""Load a model's parameters from a GGUF file: names mapped, q/k rows reordered, dequantized.

Strict like the safetensors loader: every parameter must come from the file and every tensor of
the file must land somewhere; nothing is copied until names and shapes all match. Storage types
are checked first (check_supported), so an unsupported file fails before any data is read.
With a tensor-parallel ``shard``, a column-parallel weight dequantizes only this rank's rows (the
packed rows are selected first); a row-parallel one is dequantized whole and its columns sliced.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.gguf.names import IGNORED, hf_name, qk_row_order
from kvserve.model.gguf.quant_types import check_supported, dequantize
from kvserve.model.gguf.reader import GGUFFile, TensorRecord
from kvserve.model.tensor_parallel import ShardSpec, TensorSlice
from kvserve.model.weight_checks import raise_on_mismatch, rank_shape


def load_gguf_weights(model: nn.Module, gguf_file: GGUFFile, config: ModelConfig,
                      shard: ShardSpec | None = None) -> None:
    """Copy every tensor of ``gguf_file`` into the parameter of its HF name, cast to the
    parameter's dtype and device; ModelLoadError lists unsupported types, or missing,
    unexpected and mis-shaped tensors."""
    check_supported(gguf_file)
    shard = shard or ShardSpec(0, 1)
    params = dict(model.named_parameters())  # tied parameters appear once
    by_param: dict[str, TensorRecord] = {}
    unknown = []
    for record in gguf_file.tensors.values():
        name = hf_name(record.name)
        if name is None:
            if record.name not in IGNORED:
                unknown.append(record.name)
            continue
        by_param[name] = record
    missing = sorted(set(params) - set(by_param))
    unexpected = sorted(set(by_param) - set(params)) + unknown
    slices: dict[str, TensorSlice | None] = {}
    mismatched = []
    for name, record in by_param.items():
        if name not in params:
            continue
        shape, slices[name] = rank_shape(name, record.shape, config, shard)
        if shape != list(params[name].shape):
            mismatched.append(f"{record.name} -> {name}: file {shape}, model "
                              f"{list(params[name].shape)}")
    raise_on_mismatch(f"{gguf_file.path}: tensors do not match the config "
                      f"({type(model).__name__})", missing, unexpected, mismatched)
    with torch.no_grad():
        for name, record in by_param.items():
            order = qk_row_order(name, config, gguf_file.architecture)
            params[name].copy_(torch.from_numpy(_values(record, order, slices[name])))


def _values(record: TensorRecord, order: np.ndarray | None,
            part: TensorSlice | None) -> np.ndarray:
    """This rank's part of the tensor in HF row order, as float32."""
    if part is not None and part.zero:
        return np.zeros(record.shape, np.float32)
    rows = order
    if part is not None and part.dim == 0 and len(record.shape) == 2:
        rows = (order if order is not None else np.arange(record.shape[0]))[part.start:part.stop]
        part = None
    if len(record.shape) == 1:
        values = dequantize(record)
        values = values if order is None else values[order]  # [features]
    else:
        values = dequantize(record, rows)  # [rows, in]
    if part is not None:
        index = [slice(None)] * values.ndim
        index[part.dim] = slice(part.start, part.stop)
        values = values[tuple(index)]
    values = np.ascontiguousarray(values)
    return values if values.flags.writeable else values.copy()  # F32 rows view the file
