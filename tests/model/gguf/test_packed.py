"""packed_weights: every matrix under its HF name, rows in HF order, bytes as stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf import open_gguf, packed_weights

from .conftest import GGUFFactory

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K])
def test_packed_rows_dequantize_to_transformers_weights(make_gguf: GGUFFactory,
                                                        qtype: T) -> None:
    path = make_gguf(qtype)
    packed = packed_weights(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    matrices = {n for n, t in hf.items() if t.ndim == 2}
    assert set(packed) == matrices  # untied: lm_head is there; no 1-D tensor is
    for name, weight in packed.items():
        assert weight.ggml_type == qtype
        elems, nbytes = GGML_QUANT_SIZES[qtype]
        assert (weight.block_elements, weight.block_bytes) == (elems, nbytes)
        assert weight.data.dtype == np.uint8 and not weight.data.flags.writeable
        assert weight.data.shape == (weight.shape[0], weight.shape[1] // elems * nbytes)
        np.testing.assert_array_equal(weight.dequantize(), hf[name].numpy(), err_msg=name)


def test_unpermuted_qk_are_row_permutations_and_the_rest_are_views(
        make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q4_1)
    opened = open_gguf(path)
    stored = opened.tensors
    packed = packed_weights(opened)
    q = packed["model.layers.0.self_attn.q_proj.weight"].data  # [256, row_bytes]
    raw_q = stored["blk.0.attn_q.weight"].data
    assert not np.array_equal(q, raw_q)  # llama's rows were reordered...
    assert sorted(map(bytes, q)) == sorted(map(bytes, raw_q))  # ...not changed
    v = packed["model.layers.0.self_attn.v_proj.weight"].data
    assert np.shares_memory(v, stored["blk.0.attn_v.weight"].data)  # no copy


def test_qwen2_rows_stay_in_file_order(make_gguf: GGUFFactory) -> None:
    path = make_gguf(T.Q8_0, arch="qwen2")
    packed = packed_weights(path)
    raw_q = open_gguf(path).tensors["blk.0.attn_q.weight"].data
    np.testing.assert_array_equal(packed["model.layers.0.self_attn.q_proj.weight"].data, raw_q)


def test_an_unsupported_type_is_refused_by_name(make_gguf: GGUFFactory) -> None:
    with pytest.raises(ModelLoadError, match=r"TQ2_0.*llama-quantize"):
        packed_weights(make_gguf(T.TQ2_0))
