"""kvserve's CPU attention kernel (csrc/attention.c): compiled on first use, called via ctypes.

PyTorch's CPU flash-attention kernel reaches 110-200 GFLOP/s on the prefill shapes that dominate
a shared-prefix step; this one, register-tiled for AVX-512, 270-390 on the same 2-core machine
(docs/benchmarks.md). It serves float32 CPU tensors with head dims 16, 32, ... 128; `attention`
returns None for anything else (or where the kernel cannot be built), and callers then take
their PyTorch path, which stays the reference.

Building: the C source is compiled with the system's C compiler (`$CC`, else `cc`) for this
machine's CPU (`-march=native`) into `$KVSERVE_CACHE/kernels` (else ~/.cache/kvserve/kernels),
named by a hash of source, flags and compiler, so one build serves every later process; a
failed build is logged once and never retried in the process. Threads: OpenMP, linking to the
libgomp that torch's CPU build has already loaded, so both use one pool; each call uses
`torch.get_num_threads()` threads. ctypes releases the GIL for the call.

`KVSERVE_CPU_ATTENTION=0` in the environment, or `set_enabled(False)`, turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["attention", "available", "disabled", "paged_decode", "set_enabled"]

_LOG = logging.getLogger(__name__)
_SOURCES = ("attention.c", "attention_tile.h", "decode_tile.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
HEAD_DIMS = tuple(range(16, 129, 16))  # the instances csrc/attention.c compiles


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
        ("scale", ctypes.c_float),
    ]


MAX_GROUP = 16  # query heads per kv head the decode kernel serves (MAX_GROUP in attention.c)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_enabled = os.environ.get("KVSERVE_CPU_ATTENTION", "1") != "0"


def _cache_dir() -> Path:
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")
    return root / "kernels"


def find_compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "|".join(next((ln for ln in lines if ln.startswith(w)), "") for w in wanted)


def _build(compiler: str) -> Path:
    """Compile (or find already compiled) the kernel library; raise on any failure."""
    src_dir = Path(__file__).with_name("csrc")
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((src_dir / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    digest.update(" ".join((*_FLAGS, compiler, version, _cpu_signature())).encode())
    target = _cache_dir() / f"attention-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, str(src_dir / "attention.c"), "-lm"],
                       capture_output=True, text=True, check=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if platform.machine() not in ("x86_64", "AMD64") or \
                torch.backends.cpu.get_cpu_capability() != "AVX512":
            _LOG.info("CPU attention kernel off: needs x86-64 with AVX-512")
            return None
        compiler = find_compiler()
        if compiler is None:
            _LOG.warning("CPU attention kernel off: no C compiler (set $CC or install gcc); "
                         "using PyTorch's attention")
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            _LOG.warning("CPU attention kernel off: build or load failed (%s); using "
                         "PyTorch's attention", str(detail).strip()[:500])
            return None
        lib.kvserve_attention.argtypes = [ctypes.POINTER(_Args)]
        lib.kvserve_paged_decode.argtypes = [ctypes.POINTER(_DecodeArgs)]
        lib.kvserve_attention.restype = lib.kvserve_paged_decode.restype = ctypes.c_int
        _library = lib
        return lib


def available() -> bool:
    """Whether `attention` can run here (building the kernel on first call)."""
    return _enabled and _load() is not None


def set_enabled(enabled: bool) -> None:
    """Turn the kernel on or off for this process (callers fall back to PyTorch when off)."""
    global _enabled
    _enabled = enabled


@contextmanager
def disabled() -> Iterator[None]:
    """Run a block with the kernel off (the PyTorch reference paths), then restore."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
              causal_offset: int | None = None, with_lse: bool = False,
              ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Softmax attention through the kernel, or None where it does not serve the call.

    query [q_len, H, hd]; key, value [kv_len, KVH, hd] (H a multiple of KVH; any token and head
    strides, last dim contiguous). `causal_offset` None: every query sees every key; else query
    i sees keys j <= i + causal_offset (>= 0). Returns out [q_len, H, hd] (contiguous) and, with
    `with_lse`, lse [q_len, H] (float32 log-sum-exp of each row's scaled scores).
    """
    if not _enabled or query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads = key.shape[0], key.shape[1]
    if (head_dim not in HEAD_DIMS or key.dtype != query.dtype or value.dtype != query.dtype
            or value.shape != key.shape or num_heads % num_kv_heads or not q_len or not kv_len
            or any(t.stride(-1) != 1 for t in (query, key, value))):
        return None
    if causal_offset is not None and causal_offset < 0:
        raise ValueError(f"causal_offset must be >= 0 (a query must see key 0), got "
                         f"{causal_offset}")
    lib = _load()
    if lib is None:
        return None
    out = torch.empty(q_len, num_heads, head_dim)
    lse = torch.empty(q_len, num_heads) if with_lse else None
    args = _Args(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
                 lse.data_ptr() if lse is not None else None, q_len, kv_len,
                 query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                 value.stride(0), value.stride(1), num_heads, num_kv_heads, head_dim,
                 torch.get_num_threads(), -1 if causal_offset is None else causal_offset,
                 scale)
    status = lib.kvserve_attention(ctypes.byref(args))
    if status != 0:
        raise MemoryError(f"CPU attention kernel failed (status {status}): out of memory "
                          f"for {num_kv_heads} x {head_dim} x {kv_len} keys")
    return out, lse


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
    shared head), merged in exactly. Returns [D, H, hd] (contiguous).
    """
    if not _enabled or query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if (head_dim not in HEAD_DIMS or num_heads % num_kv_heads
            or num_heads // num_kv_heads > MAX_GROUP or query.stride(-1) != 1
            or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or tables.dtype != torch.int64 or tables.stride(-1) != 1):
        return None
    lib = _load()
    if lib is None:
        return None
    ends = ends.to(torch.int64).contiguous()
    if starts is not None:
        starts = starts.to(torch.int64).contiguous()
    prior_out = prior_lse = None
    if prior is not None:
        prior_out, prior_lse = prior[0].contiguous(), prior[1].float().contiguous()
    out = torch.empty(num_decodes, num_heads, head_dim)
    args = _DecodeArgs(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        None if starts is None else starts.data_ptr(), ends.data_ptr(),
        None if prior_out is None else prior_out.data_ptr(),
        None if prior_lse is None else prior_lse.data_ptr(), out.data_ptr(),
        num_decodes, tables.stride(0), key_cache.shape[1], query.stride(0), query.stride(1),
        num_heads, num_kv_heads, head_dim, torch.get_num_threads(), scale)
    if lib.kvserve_paged_decode(ctypes.byref(args)) != 0:
        return None
    return out
