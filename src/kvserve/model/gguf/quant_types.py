"""Which GGUF storage types kvserve loads, the refusal of every other one, and dequantization.

Supported are the float types and the classic and K-quant block formats whose dequantization the
``gguf`` package implements and transformers cross-checks (tests/model/gguf); the i-quants,
ternary and fp4 formats are refused by name before any tensor is read, so a user learns at once
what to re-quantize to rather than after minutes of loading.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.reader import GGUFFile, TensorRecord

SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                   T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
SUPPORTED_TYPE_NAMES = tuple(t.name for t in SUPPORTED_TYPES)
_MAX_NAMED = 3


def check_supported(gguf_file: GGUFFile) -> None:
    """Raise ModelLoadError naming every unsupported storage type in the file (with up to three
    of its tensors each) and what to do instead; read no tensor data."""
    offending: dict[str, list[str]] = defaultdict(list)
    for record in gguf_file.tensors.values():
        if record.ggml_type not in SUPPORTED_TYPES:
            offending[record.type_name].append(record.name)
    if not offending:
        return
    named = "; ".join(
        f"{kind} ({', '.join(names[:_MAX_NAMED])}"
        f"{f' and {len(names) - _MAX_NAMED} more' if len(names) > _MAX_NAMED else ''})"
        for kind, names in sorted(offending.items()))
    raise ModelLoadError(
        f"{gguf_file.path}: tensor type {', '.join(sorted(offending))} is not supported by "
        f"kvserve: {named}. Supported: {', '.join(SUPPORTED_TYPE_NAMES)}. Re-quantize the "
        "original model to one of them with llama.cpp's llama-quantize (e.g. "
        "`llama-quantize --allow-requantize in.gguf out.gguf Q4_K_M`, or Q8_0), or serve the "
        "Hugging Face safetensors checkpoint instead")


def dequantize(record: TensorRecord, rows: np.ndarray | None = None) -> np.ndarray:
    """The tensor's values as float32 in its logical shape; with ``rows`` (indices into the
    packed rows) only those rows, in that order: ``[len(rows), in]``."""
    if record.ggml_type not in SUPPORTED_TYPES:  # check_supported runs first; a bug otherwise
        raise AssertionError(f"{record.name}: {record.type_name} reached dequantize")
    data = record.data if rows is None else record.data[rows]  # [rows, row_bytes]
    if record.ggml_type == T.F32:
        values = data.view(np.float32)
    elif record.ggml_type == T.F16:
        values = data.view(np.float16).astype(np.float32)
    else:
        values = quants.dequantize(data, record.ggml_type).astype(np.float32, copy=False)
    shape = record.shape if rows is None else (len(rows), record.shape[-1])
    return values.reshape(shape)
