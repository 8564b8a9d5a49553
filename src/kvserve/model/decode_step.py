"""The fused decode step (csrc/decode_step.c): every decoder layer of a step whose sequences all
decode, in one kernel call, for bf16 models whose projections run on kvserve's bf16 matmul, for
float32 models whose projections are GGUF blocks kept packed (quant_linear's
BlockKernelLinear: Q4_1, Q8_0), and for either whose projections are int8 x int8 on kvserve's
VNNI kernel (int8_linear's Int8Linear).

At one to a few tokens a step, the per-op path's Python and ATen dispatch (about ten calls a
layer) costs as much as its matmuls read weights in (docs/benchmarks.md has the profile). The
fused step calls the same kernels on the same bf16 tensors in the same order, from C, so its
output is the per-op path's bit for bit (tests/model/test_decode_step.py checks it). It serves
only what those kernels serve: no LoRA deltas, no tensor parallelism, no q/k norms or sliding
windows, a KV cache in the model's dtype (or bf16 or fp16 under a float32 model: the step
rounds each new K/V row as torch does), no more decodes than the block kernels take a call
(KERNEL_MAX_TOKENS) for packed weights, and decodes that share no cascade head (those keep the
cascade's one read of the head); `FusedDecode.__call__` returns None for anything else, and the
caller runs the per-op path.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.model import cpu_kernels
from kvserve.model.attention_metadata import AttentionMetadata
from kvserve.model.bf16_linear import Bf16Linear, kernel_serves_bf16
from kvserve.model.cpu_attention import HEAD_DIMS, KV_CODES, MAX_GROUP
from kvserve.model.int8_linear import Int8Linear
from kvserve.model.paged_attention import KVCache
from kvserve.model.quant_linear import KERNEL_MAX_TOKENS, BlockKernelLinear

if TYPE_CHECKING:
    from kvserve.model.llama import DecoderModel

__all__ = ["FusedDecode"]

_P = ctypes.c_void_p


_PROJ_BF16, _PROJ_Q4, _PROJ_Q8, _PROJ_I8 = 0, 1, 2, 3  # decode_step.c's projection kinds


class _Proj(ctypes.Structure):
    """struct decode_proj in decode_step.c."""

    _fields_ = [("codes", _P), ("scale", _P), ("min", _P), ("bias", _P), ("kind", ctypes.c_long)]


class _Layer(ctypes.Structure):
    """struct decode_layer in decode_step.c."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P),
        ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
        ("k_cache", _P), ("v_cache", _P),
    ]


class _StepArgs(ctypes.Structure):
    """struct decode_step_args in decode_step.c."""

    _fields_ = [
        ("layers", _P), ("final_norm", _P), ("hidden", _P), ("out", _P),
        ("cos", _P), ("sin", _P), ("slots", _P), ("tables", _P), ("ends", _P),
        ("num_layers", ctypes.c_long), ("num_decodes", ctypes.c_long),
        ("table_stride", ctypes.c_long), ("block_size", ctypes.c_long),
        ("hidden_size", ctypes.c_long), ("intermediate_size", ctypes.c_long),
        ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int), ("num_threads", ctypes.c_int), ("bf16", ctypes.c_int),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_dtype", ctypes.c_int),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _proj(op: object) -> _Proj:
    """A projection as decode_step.c reads it (`_serves` has checked its kind)."""
    if isinstance(op, Bf16Linear):
        return _Proj(op.packed.data_ptr(), None, None, _ptr(op.bias), _PROJ_BF16)
    if isinstance(op, Int8Linear):
        assert op.packed is not None
        return _Proj(op.packed.data_ptr(), op.scales.data_ptr(), None, _ptr(op.bias), _PROJ_I8)
    assert isinstance(op, BlockKernelLinear)
    if op.is_q8:
        return _Proj(op.codes.data_ptr(), op.scale.data_ptr(), None, _ptr(op.bias), _PROJ_Q8)
    return _Proj(op.codes.data_ptr(), op.scale.data_ptr(), op.min.data_ptr(), _ptr(op.bias),
                 _PROJ_Q4)


def _serves(op: object, dtype: torch.dtype) -> bool:
    """Whether the kernel runs this projection for a model of `dtype`: kvserve's bf16 matmul
    for bf16 models (on AVX512-BF16), GGUF blocks through quant_matmul.c for float32 ones, and
    the int8 kernel (on AVX512-VNNI) for either."""
    if isinstance(op, Int8Linear):
        return op.packed is not None and dtype in (torch.bfloat16, torch.float32)
    if dtype == torch.bfloat16:
        return isinstance(op, Bf16Linear) and op.in_features % 2 == 0 and kernel_serves_bf16()
    return dtype == torch.float32 and isinstance(op, BlockKernelLinear)


class FusedDecode:
    """Runs a DecoderModel's layers for pure-decode steps in one call (see the module doc).

    Build it with `FusedDecode.build(model)` once the model is packed; it keeps the packed
    weights' addresses, which never move, and refreshes the caches' when they change."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.head_dim
        self.hidden_size = model.norm.weight.shape[0]
        self.dtype = model.norm.weight.dtype
        self._bf16 = int(self.dtype == torch.bfloat16)  # decode_step_args.bf16
        # The caches it writes: bf16 under bf16 activations; float32, bf16 or fp16 under float32
        self._cache_dtypes = ((torch.bfloat16,) if self._bf16 else
                              (torch.float32, torch.bfloat16, torch.float16))
        down = model.layers[0].mlp.packed_down
        assert isinstance(down, Bf16Linear | BlockKernelLinear | Int8Linear)
        self.intermediate_size = down.in_features
        self.eps = model.norm.eps
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # The modules whose LoRA deltas and all-reduce each step checks, held directly: reading
        # a submodule through nn.Module.__getattr__ cost ~300 µs a step on 30 layers.
        self._modules = tuple((layer, layer.self_attn, layer.mlp) for layer in model.layers)
        self._layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ops = (attn.packed_qkv, attn.packed_o, mlp.packed_gate_up, mlp.packed_down)
            self._layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *(_proj(op) for op in ops), 0, 0)
        self._caches: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: DecoderModel) -> FusedDecode | None:
        """The fused step for `model` (packed: bf16, or float32 over GGUF blocks), or None where
        its kernels cannot run it."""
        if not model.layers or cpu_kernels.library("decode_step") is None:
            return None
        hidden = model.norm.weight
        first = model.layers[0].self_attn
        head_dim, heads, kv_heads = first.head_dim, first.num_heads, first.num_kv_heads
        if (hidden.dtype not in (torch.bfloat16, torch.float32) or hidden.shape[0] % 16
                or head_dim not in HEAD_DIMS or head_dim % 32 or heads % kv_heads
                or heads // kv_heads > MAX_GROUP):
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ops = (attn.packed_qkv, attn.packed_o, mlp.packed_gate_up, mlp.packed_down)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (attn.q_norm is not None or attn.sliding_window is not None
                    or not all(_serves(op, hidden.dtype) for op in ops)
                    or any(w.dtype != hidden.dtype or not w.is_contiguous() for w in norms)):
                return None
        down = model.layers[0].mlp.packed_down
        assert isinstance(down, Bf16Linear | BlockKernelLinear | Int8Linear)  # passed _serves
        if down.in_features % 16:
            return None
        return cls(model)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: Sequence[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """hidden [D, hidden] (the embeddings; overwritten) -> the final-normed hidden
        [D, hidden], with every layer's K/V written; None (nothing touched) where the step is
        not one the kernel runs."""
        lib = cpu_kernels.library("decode_step")
        if lib is None or meta.prefill_seq_idx or not self._plain():
            return None
        plan = meta.decode_batch()
        cache = kv_caches[0]
        if (plan is None or meta.decode_cascade(cache.block_size) is not None
                or cache.key_cache.dtype not in self._cache_dtypes
                or hidden.dtype != self.dtype
                or (self.dtype == torch.float32 and hidden.shape[0] > KERNEL_MAX_TOKENS)
                or not hidden.is_contiguous() or hidden.shape[0] != plan.seq_lens.shape[0]
                or cos.dtype != torch.float32 or not cos.is_contiguous()
                or not sin.is_contiguous() or plan.block_tables.stride(-1) != 1):
            return None
        if not self._point_at(kv_caches):
            return None
        slots = meta.slot_mapping.to(torch.int64)
        out = torch.empty_like(hidden)
        args = _StepArgs(
            ctypes.addressof(self._layers), self.model.norm.weight.data_ptr(),
            hidden.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), plan.block_tables.data_ptr(), plan.seq_lens.data_ptr(),
            len(self._layers), hidden.shape[0], plan.block_tables.stride(0), cache.block_size,
            self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
            self.head_dim, torch.get_num_threads(), self._bf16, self.eps, self.scale,
            KV_CODES[cache.key_cache.dtype])
        status = lib.kvserve_decode_step(ctypes.addressof(args))
        if status != 0:
            raise RuntimeError(f"kvserve's fused decode step failed (status {status}: -2 is "
                               "out of memory)")
        return out

    def _plain(self) -> bool:
        """No LoRA deltas and no tensor parallelism right now (both are set after building)."""
        return all(attn.lora is None and mlp.lora is None and layer.all_reduce is None
                   for layer, attn, mlp in self._modules)

    def _point_at(self, kv_caches: Sequence[KVCache]) -> bool:
        """Each layer's cache addresses, rewritten only when the caches change; False where
        they are not one contiguous KVCache a layer, all in one dtype."""
        addresses = tuple(p for c in kv_caches
                          for p in (c.key_cache.data_ptr(), c.value_cache.data_ptr()))
        if addresses == self._caches:
            return True
        if len(kv_caches) != len(self._layers) or not all(
                t.is_contiguous() and t.dtype == kv_caches[0].key_cache.dtype
                for c in kv_caches for t in (c.key_cache, c.value_cache)):
            return False
        for entry, cache in zip(self._layers, kv_caches, strict=True):
            entry.k_cache = cache.key_cache.data_ptr()
            entry.v_cache = cache.value_cache.data_ptr()
        self._caches = addresses
        return True
