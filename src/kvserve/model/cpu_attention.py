"""kvserve's CPU attention kernels (csrc/attention.c) through ctypes: prefill attention and
paged decode, computing in float32.

Both take float32 or bfloat16 queries (K and V float16 too) and return the query's dtype. K
and V (and prefill's queries) are read in place, 16-bit rows widened as they load; a decode's
bf16 query, one row a sequence, is widened in a copy first.

PyTorch's CPU flash-attention kernel reaches 110-200 GFLOP/s on the prefill shapes that dominate
a shared-prefix step; this one, register-tiled for AVX-512, 300-440 on the same 2-core machine
(docs/benchmarks.md). Both functions return None where the kernels do not serve the call (see
cpu_kernels: not built here, turned off, or another dtype, head dim or layout), and callers then
take their PyTorch path, which stays the reference.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model import cpu_kernels

__all__ = ["HEAD_DIMS", "MAX_GROUP", "attention", "paged_decode"]

HEAD_DIMS = tuple(range(16, 129, 16))  # the instances csrc/attention.c compiles
MAX_GROUP = 16  # query heads per kv head the decode kernel serves (MAX_GROUP in attention.c)


class _Args(ctypes.Structure):
    """Mirror of `struct attention_args` in csrc/attention.c (field order matters)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        *((name, ctypes.c_long) for name in (
            "q_len", "kv_len", "q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h",
            "v_stride_t", "v_stride_h")),
        ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int), ("num_threads", ctypes.c_int),
        ("causal_offset", ctypes.c_long), ("scale", ctypes.c_float),
        ("q_bf16", ctypes.c_int), ("kv_dtype", ctypes.c_int),
    ]


class _DecodeArgs(ctypes.Structure):
    """Mirror of `struct decode_args` in csrc/attention.c (field order matters)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "q", "k_cache", "v_cache", "tables", "starts", "ends", "prior_out", "prior_lse",
            "out")),
        *((name, ctypes.c_long) for name in (
            "num_decodes", "table_stride", "block_size", "q_stride_t", "q_stride_h")),
        *((name, ctypes.c_int) for name in (
            "num_heads", "num_kv_heads", "head_dim", "num_threads")),
        ("scale", ctypes.c_float), ("kv_dtype", ctypes.c_int),
    ]


_DTYPES = (torch.float32, torch.bfloat16)  # the queries the kernels take (computed in float32)
# K/V element types, as csrc/kv_dtype.h codes them (16-bit ones widened as they load).
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
              causal_offset: int | None = None, with_lse: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Softmax attention through the kernel, or None where it does not serve the call.

    query [q_len, H, hd]; key, value [kv_len, KVH, hd] (H a multiple of KVH; any token and head
    strides, last dim contiguous). `causal_offset` None: every query sees every key; else query
    i sees keys j <= i + causal_offset (>= 0). Returns out [q_len, H, hd] (contiguous, query's
    dtype) and, with `with_lse`, lse [q_len, H] (float32 log-sum-exp of each row's scaled
    scores). query float32 or bfloat16; key and value also float16.
    """
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return None
    q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[0], key.shape[1]
    if (head_dim not in HEAD_DIMS or key.dtype not in KV_CODES or value.dtype not in KV_CODES
            or value.shape != key.shape or num_heads % num_kv_heads or not q_len or not kv_len
            or any(t.stride(-1) != 1 for t in (query, key, value))):
        return None
    if causal_offset is not None and causal_offset < 0:
        raise ValueError(f"causal_offset must be >= 0 (a query must see key 0), got "
                         f"{causal_offset}")
    lib = cpu_kernels.library("attention")
    if lib is None:
        return None
    dtype = query.dtype
    if key.dtype != value.dtype:  # the kernel reads k and v in one dtype
        key, value = key.float(), value.float()
    out = torch.empty(q_len, num_heads, head_dim)
    lse = torch.empty(q_len, num_heads) if with_lse else None
    args = _Args(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
                 lse.data_ptr() if lse is not None else None, q_len, kv_len,
                 query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                 value.stride(0), value.stride(1), num_heads, num_kv_heads, head_dim,
                 torch.get_num_threads(), -1 if causal_offset is None else causal_offset,
                 scale, int(query.dtype == torch.bfloat16), KV_CODES[key.dtype])
    status = lib.kvserve_attention(ctypes.addressof(args))
    if status != 0:
        raise MemoryError(f"CPU attention kernel failed (status {status}): out of memory "
                          f"for {num_kv_heads} x {head_dim} x {kv_len} keys")
    return out.to(dtype), lse


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 tables: torch.Tensor, ends: torch.Tensor, scale: float, *,
                 starts: torch.Tensor | None = None,
                 prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """One query token per decode over its keys, read in place from the paged cache; None
    where the kernel does not serve the call.

    query [D, H, hd] (last dim contiguous); key_cache, value_cache [num_blocks, block_size,
    KVH, hd] (contiguous); tables [D, max_blocks] int64 (row i: decode i's blocks in position
    order); decode i attends to positions [starts[i] (0 when None), ends[i]) (int64 [D];
    ends > starts). `prior` (out [D, H, hd], lse [D, H]): a softmax part over other keys (a
    shared head), merged in exactly. Returns [D, H, hd] (contiguous, query's dtype). Caches
    float32, bfloat16 or float16 (one dtype), read in place; a bf16 query is widened first.
    """
    if query.device.type != "cpu" or query.dtype not in _DTYPES:
        return None
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if (head_dim not in HEAD_DIMS or num_heads % num_kv_heads
            or num_heads // num_kv_heads > MAX_GROUP or query.stride(-1) != 1
            or key_cache.dtype not in KV_CODES or value_cache.dtype != key_cache.dtype
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or tables.dtype != torch.int64 or tables.stride(-1) != 1):
        return None
    lib = cpu_kernels.library("paged_decode")
    if lib is None:
        return None
    dtype = query.dtype
    if dtype != torch.float32:
        query = query.float()
    ends = ends.to(torch.int64).contiguous()
    if starts is not None:
        starts = starts.to(torch.int64).contiguous()
    prior_out = prior_lse = None
    if prior is not None:
        prior_out, prior_lse = prior[0].float().contiguous(), prior[1].float().contiguous()
    out = torch.empty(num_decodes, num_heads, head_dim)
    args = _DecodeArgs(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        None if starts is None else starts.data_ptr(), ends.data_ptr(),
        None if prior_out is None else prior_out.data_ptr(),
        None if prior_lse is None else prior_lse.data_ptr(), out.data_ptr(),
        num_decodes, tables.stride(0), key_cache.shape[1], query.stride(0), query.stride(1),
        num_heads, num_kv_heads, head_dim, torch.get_num_threads(), scale,
        KV_CODES[key_cache.dtype])
    if lib.kvserve_paged_decode(ctypes.addressof(args)) != 0:
        return None
    return out.to(dtype)
