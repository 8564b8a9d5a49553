"""kvserve's CPU kernels (the C sources in csrc/): built on first use, loaded through ctypes.

The kernels serve float32 on x86-64 CPUs with AVX-512: attention and paged decode
(cpu_attention), the fused position-wise ops of a layer (cpu_pointwise), and matmuls by weights
kept in GGUF's 4- and 8-bit blocks (quant_linear). Where they cannot
be built, or are turned off, `library()` is None and every caller takes its PyTorch path, which
stays the reference the kernels are tested against.

Building: every csrc/*.c is compiled with the system's C compiler (`$CC`, else `cc` or `gcc`)
for this machine's CPU (`-march=native`) into one library in `$KVSERVE_CACHE/kernels` (else
~/.cache/kvserve/kernels), named by a hash of the sources, flags, compiler and CPU, so one build
(about 2 s) serves every later process; a failed build is logged once and not retried in the
process. Threads: OpenMP, linked to the libgomp that torch's CPU build has already loaded, so
kernels and torch share one pool; each call passes `torch.get_num_threads()`. ctypes releases
the GIL for the call.

`KVSERVE_CPU_KERNELS=0` in the environment, or `set_enabled(False)`, turns the kernels off.
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

__all__ = ["available", "disabled", "find_compiler", "library", "set_enabled"]

_LOG = logging.getLogger(__name__)
_SRC_DIR = Path(__file__).with_name("csrc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # every exported kernel's parameters (each returns int: 0 on success)
    "kvserve_attention": (_P,),  # struct attention_args *
    "kvserve_paged_decode": (_P,),  # struct decode_args *
    "kvserve_rms_norm": (_P, _L, _P, _L, _P, _P, _L, _L, _L, _F, _I),
    "kvserve_silu_mul": (_P, _L, _P, _L, _L, _L, _I),
    "kvserve_rotary": (_P, _L, _L, _L, _L, _L, _P, _P, _I),
    "kvserve_q4_matmul": (_P, _L, _P, _P, _P, _P, _L, _L, _L, _L, _I),
    "kvserve_q8_matmul": (_P, _L, _P, _P, _P, _L, _L, _L, _L, _I),
}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_enabled = os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"


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


def build(compiler: str) -> Path:
    """Compile the kernel library (or find it already compiled); raise on any failure."""
    sources = sorted(p for p in _SRC_DIR.iterdir() if p.suffix in (".c", ".h"))
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    digest.update(" ".join((*_FLAGS, compiler, version, _cpu_signature())).encode())
    target = _cache_dir() / f"kvserve-kernels-{digest.hexdigest()[:16]}.so"
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
    global _library, _tried
    if _tried:  # every kernel call passes here: no lock once the first load is done
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        if platform.machine() not in ("x86_64", "AMD64") or \
                torch.backends.cpu.get_cpu_capability() != "AVX512":
            _LOG.info("kvserve's CPU kernels off: they need x86-64 with AVX-512")
            return None
        compiler = find_compiler()
        if compiler is None:
            _LOG.warning("kvserve's CPU kernels off: no C compiler (set $CC or install gcc); "
                         "using PyTorch's ops")
            return None
        try:
            lib = ctypes.CDLL(str(build(compiler)))
            for name, argtypes in _SIGNATURES.items():
                getattr(lib, name).argtypes = argtypes
                getattr(lib, name).restype = ctypes.c_int
            _library = lib
        except (OSError, AttributeError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            _LOG.warning("kvserve's CPU kernels off: build or load failed (%s); using "
                         "PyTorch's ops", str(detail).strip()[:500])
        return _library


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built on first call), or None where they are off or unavailable."""
    return _load() if _enabled else None


def available() -> bool:
    """Whether the kernels can run here (building them on first call)."""
    return library() is not None


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
