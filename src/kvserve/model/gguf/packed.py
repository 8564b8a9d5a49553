"""The matrices of a GGUF file still packed in their quantized blocks, under HF names.

For code that multiplies by quantized weights directly (reading 4-8x fewer bytes per decode step
than a dequantized copy): each ``PackedWeight`` is a matrix's rows exactly as stored, except that
llama's q/k rows are already put back in HF order, so row i of ``data`` is output feature i of
the HF parameter of that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.config import config_from_gguf
from kvserve.model.gguf.names import hf_name, qk_row_order
from kvserve.model.gguf.quant_types import check_supported, dequantize
from kvserve.model.gguf.reader import GGUFFile, TensorRecord, open_gguf


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """One [out, in] matrix in GGUF blocks: each row is ``in / block_elements`` blocks of
    ``block_bytes`` bytes (llama.cpp's layout for ``ggml_type``); F32/F16/BF16 rows are plain
    little-endian values. ``data`` is read-only (a view of the mapped file, or a permuted copy)."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # [out_features, in_features]
    data: np.ndarray  # [out_features, row_bytes] uint8

    @property
    def block_elements(self) -> int:
        """Weights per block (32 for Q4_0..Q8_0, 256 for the K-quants, 1 for float types)."""
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per block (e.g. 20 for Q4_1: two fp16 scales and 16 bytes of nibbles)."""
        return GGML_QUANT_SIZES[self.ggml_type][1]

    def dequantize(self) -> np.ndarray:
        """The matrix as float32 ``[out, in]`` (the reference for packed kernels)."""
        record = TensorRecord("packed", self.ggml_type, self.shape, self.data)
        return dequantize(record)


def packed_weights(source: str | Path | GGUFFile,
                   config: ModelConfig | None = None) -> dict[str, PackedWeight]:
    """Every 2-D weight of the file (projections, embeddings, lm_head when untied) by HF
    parameter name, packed; 1-D tensors (norms, biases) are left out.

    ``config`` (default: from the file's metadata) gives the head counts that llama's q/k row
    order depends on. Raises ModelLoadError for an unsupported storage type, before any data
    is touched, as the loader does.
    """
    gguf_file = source if isinstance(source, GGUFFile) else open_gguf(source)
    check_supported(gguf_file)
    config = config or config_from_gguf(gguf_file)
    packed = {}
    for record in gguf_file.tensors.values():
        name = hf_name(record.name)
        if name is None or len(record.shape) != 2:
            continue
        order = qk_row_order(name, config, gguf_file.architecture)
        if order is not None and len(order) != record.shape[0]:
            raise ModelLoadError(f"{gguf_file.path}: {record.name} has {record.shape[0]} rows, "
                                 f"the config's heads need {len(order)}")
        data = record.data if order is None else record.data[order]  # [out, row_bytes]
        data = data.view()
        data.flags.writeable = False
        packed[name] = PackedWeight(record.ggml_type, (record.shape[0], record.shape[1]), data)
    return packed
