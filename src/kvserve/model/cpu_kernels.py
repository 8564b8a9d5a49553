"""kvserve's CPU kernels (the C sources in csrc/): built on first use, loaded through ctypes.

The kernels compute in float32 on x86-64 CPUs (attention and the position-wise ops also read and
write bfloat16 tensors), in families (FAMILIES): prefill attention and paged decode
(cpu_attention), the fused position-wise ops of a layer (cpu_pointwise), matmuls by weights kept
in GGUF's 4- and 8-bit blocks (quant_linear), bf16 and int8 x int8 matmuls (bf16_linear,
int8_linear), and the fused decode step (decode_step). Which families a CPU gets is chosen at
run time from its vector unit (torch's `get_cpu_capability()`): with AVX-512 every family
(csrc/*.c); with AVX2 and FMA but no AVX-512 paged decode, the position-wise ops, the block
matmuls and the fused decode step over blocks (csrc/avx2/*.c, the same kernels at 8 lanes). A
family not built here, or no kernels at all, makes `library(family)` None, and every caller then
takes its PyTorch path, which stays the reference the kernels are tested against.
`KVSERVE_CPU_KERNELS_ISA=avx2` builds the AVX2 set on an AVX-512 CPU (so one machine tests
both).

Building: the chosen set is compiled with the system's C compiler (`$CC`, else `cc` or `gcc`)
for this machine's CPU (`-march=native`) into one library in `$KVSERVE_CACHE/kernels` (else
~/.cache/kvserve/kernels), named by a hash of the sources, flags, compiler and CPU, so one build
(about 2 s) serves every later process; a failed build is logged once and not retried in the
process. Threads: OpenMP, linked to the libgomp that torch's CPU build has already loaded, so
kernels and torch share one pool; each call passes `torch.get_num_threads()`. ctypes releases
the GIL for the call.

`KVSERVE_CPU_KERNELS=0` in the environment (`ENV_ENABLED` False), or `set_enabled(False)`,
turns the kernels off; an engine started with `cpu_kernels=True` still honours the variable.
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
from typing import Any

import torch

__all__ = ["ENV_ENABLED", "FAMILIES", "available", "disabled", "families", "find_compiler",
           "kernel_set", "library", "set_enabled"]

_LOG = logging.getLogger(__name__)
_SRC_DIR = Path(__file__).with_name("csrc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
FAMILIES: dict[str, dict[str, tuple[Any, ...]]] = {  # family: kernel: its parameters
    # (each kernel returns int: 0 on success)
    "attention": {"kvserve_attention": (_P,)},  # struct attention_args *
    "paged_decode": {"kvserve_paged_decode": (_P,)},  # struct decode_args *
    "pointwise": {"kvserve_rms_norm": (_P, _L, _P, _L, _P, _P, _L, _L, _L, _F, _I, _I),
                  "kvserve_silu_mul": (_P, _L, _P, _L, _L, _L, _I, _I),
                  "kvserve_rotary": (_P, _L, _L, _L, _L, _L, _P, _P, _I, _I)},
    "quant": {"kvserve_q4_matmul": (_P, _L, _P, _P, _P, _P, _L, _L, _L, _L, _I),
              "kvserve_q8_matmul": (_P, _L, _P, _P, _P, _L, _L, _L, _L, _I),
              "kvserve_q4_dequantize": (_P, _P, _P, _P, _L, _L, _I),
              "kvserve_q8_dequantize": (_P, _P, _P, _L, _L, _I),
              "kvserve_quant_gemm_built": ()},
    "bf16_matmul": {"kvserve_bf16_matmul": (_P, _L, _L, _P, _L, _L, _P, _P, _L, _I, _I)},
    "int8_matmul": {"kvserve_i8_matmul": (_P, _L, _I, _L, _P, _P, _L, _L, _P, _P, _L, _I, _I)},
    "decode_step": {"kvserve_decode_step": (_P,)},  # struct decode_step_args *
}
_KERNEL_SETS = {  # ISA: (source folder under csrc/, the families its sources export)
    "avx512": ("", ("attention", "paged_decode", "pointwise", "quant", "bf16_matmul",
                       "int8_matmul", "decode_step")),
    "avx2": ("avx2", ("paged_decode", "pointwise", "quant", "decode_step")),
}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_families: tuple[str, ...] = ()
_tried = False
ENV_ENABLED = os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"
_enabled = ENV_ENABLED


def find_compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")
    return root / "kernels"


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "|".join(next((ln for ln in lines if ln.startswith(w)), "") for w in wanted)


def kernel_set() -> str | None:
    """The kernel set this CPU runs ("avx512" or "avx2"), or None where no set fits: x86-64
    with AVX-512, else with AVX2 (and FMA, which torch's AVX2 level implies);
    `KVSERVE_CPU_KERNELS_ISA=avx2` picks the AVX2 set on an AVX-512 CPU."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    wanted = os.environ.get("KVSERVE_CPU_KERNELS_ISA", "").lower()
    if wanted not in ("", *_KERNEL_SETS):
        _LOG.warning("KVSERVE_CPU_KERNELS_ISA=%s is not one of %s: ignored", wanted,
                     ", ".join(_KERNEL_SETS))
    if capability == "AVX512":
        return "avx2" if wanted == "avx2" else "avx512"
    return "avx2" if capability == "AVX2" else None


def build(compiler: str, isa: str = "avx512") -> Path:
    """Compile `isa`'s kernel library (or find it already compiled); raise on any failure."""
    folder = _SRC_DIR / _KERNEL_SETS[isa][0]
    sources = sorted(p for p in folder.iterdir() if p.suffix in (".c", ".h"))
    # A set in a subfolder may include csrc/'s files (../paged_decode.h, ../decode_step.c):
    # they count too.
    shared = [] if folder == _SRC_DIR else sorted(
        p for p in _SRC_DIR.iterdir() if p.suffix in (".c", ".h"))
    digest = hashlib.sha256()
    for path in [*sources, *shared]:
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    digest.update(" ".join((*_FLAGS, compiler, version, _cpu_signature())).encode())
    target = _cache_dir() / f"kvserve-kernels-{isa}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        c_files = [str(p) for p in sources if p.suffix == ".c"]
        subprocess.run([compiler, *_FLAGS, "-o", tmp, *c_files, "-lm"],
                       capture_output=True, text=True, check=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _families, _tried
    if _tried:  # every kernel call passes here: no lock once the first load is done
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        isa = kernel_set()
        if isa is None:
            _LOG.info("kvserve's CPU kernels off: they need x86-64 with AVX-512 or AVX2")
            return None
        compiler = find_compiler()
        if compiler is None:
            _LOG.warning("kvserve's CPU kernels off: no C compiler (set $CC or install gcc); "
                         "using PyTorch's ops")
            return None
        try:
            lib = ctypes.CDLL(str(build(compiler, isa)))
            families = _KERNEL_SETS[isa][1]
            for family in families:
                for name, argtypes in FAMILIES[family].items():
                    getattr(lib, name).argtypes = argtypes
                    getattr(lib, name).restype = ctypes.c_int
            _library, _families = lib, families
            _LOG.info("kvserve's CPU kernels (%s): %s", isa, ", ".join(families))
        except (OSError, AttributeError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            _LOG.warning("kvserve's CPU kernels off: build or load failed (%s); using "
                         "PyTorch's ops", str(detail).strip()[:500])
        return _library


def library(family: str) -> ctypes.CDLL | None:
    """The loaded kernels (built on first call) when they include `family` (a FAMILIES key),
    else None: kernels off, unavailable here, or this CPU's set lacks the family."""
    if not _enabled:
        return None
    lib = _load()
    return lib if family in _families else None


def families() -> tuple[str, ...]:
    """The kernel families that run here (building them on first call); () when off."""
    return _families if _enabled and _load() is not None else ()


def available(family: str) -> bool:
    """Whether `family`'s kernels can run here (building them on first call)."""
    return library(family) is not None


def set_enabled(enabled: bool) -> None:
    """Turn the kernels on or off for this process (callers fall back to PyTorch when off)."""
    global _enabled
    _enabled = enabled


@contextmanager
def disabled() -> Iterator[None]:
    """Run a block with the kernels off (the PyTorch reference paths), then restore."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
