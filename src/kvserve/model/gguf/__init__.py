"""GGUF checkpoints (llama.cpp's single-file format) in kvserve's own loader.

One concept per module: ``reader`` (the file as metadata + packed tensor rows, memory-mapped),
``config`` (ModelConfig from the metadata), ``tokenizer`` (a ``tokenizers.Tokenizer`` from the
``tokenizer.ggml.*`` keys), ``names`` (GGUF -> HF parameter names, llama's q/k row order),
``quant_types`` (what is loaded, what is refused by name, dequantization), ``weights`` (loading a
model's parameters, dequantized, optionally one tensor-parallel rank's slices) and ``packed``.

Packed weights, for kernels that multiply by quantized blocks directly::

    packed_weights(source: str | Path | GGUFFile, config: ModelConfig | None = None)
        -> dict[str, PackedWeight]   # HF parameter name -> the matrix as stored

    @dataclass(frozen=True, slots=True)
    class PackedWeight:
        ggml_type: gguf.GGMLQuantizationType   # Q4_0, Q4_1, Q8_0, Q4_K, F32, ...
        shape: tuple[int, int]                  # [out_features, in_features]
        data: np.ndarray                        # [out_features, row_bytes] uint8, read-only
        block_elements: int  (property)         # weights per block (32, 256; 1 for floats)
        block_bytes: int     (property)         # bytes per block
        def dequantize(self) -> np.ndarray      # float32 [out, in], the reference

Every 2-D weight is there (q/k/v/o, gate/up/down, embed_tokens, lm_head when untied); 1-D
tensors (norms, biases) are not. Row i of ``data`` is row i of the HF parameter: llama's
permuted q/k rows are already put back (``names.qk_row_order``), so a packed matmul against
``data`` equals ``x @ W.T`` with the dequantized HF weight W. Unsupported types raise
ModelLoadError before any data is read, as loading does.
"""

from kvserve.model.gguf.config import config_from_gguf
from kvserve.model.gguf.packed import PackedWeight, packed_weights
from kvserve.model.gguf.quant_types import SUPPORTED_TYPE_NAMES, check_supported
from kvserve.model.gguf.reader import GGUFFile, TensorRecord, open_gguf

__all__ = [
    "SUPPORTED_TYPE_NAMES",
    "GGUFFile",
    "PackedWeight",
    "TensorRecord",
    "check_supported",
    "config_from_gguf",
    "open_gguf",
    "packed_weights",
]
