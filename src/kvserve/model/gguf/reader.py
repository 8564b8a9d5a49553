"""Open a .gguf file: its metadata as plain Python values and its tensors as packed byte rows.

The file is memory-mapped; every ``TensorRecord.data`` is a view into that map (no copy), so
opening a multi-gigabyte file costs page-table entries, not RAM. Type names and block sizes are
the ``gguf`` package's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.model.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor as stored: ``shape`` is logical and row-major (torch's order, e.g. [out, in] for
    a linear weight; GGUF itself lists dimensions innermost first). ``data`` holds each row's
    blocks unchanged, so row r of ``data`` is row r of the tensor (all leading dims flattened)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # [rows, row_bytes] uint8, a view into the mapped file

    @property
    def type_name(self) -> str:
        """llama.cpp's name of the storage type (``Q4_1``, ``F32``...)."""
        return self.ggml_type.name


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A parsed .gguf file: ``metadata`` (key -> str/int/float/bool or list of them) and its
    tensors by GGUF name, in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorRecord]

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``...); the prefix of the model's keys."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: no 'general.architecture' in its metadata; not "
                                 "a model GGUF written by llama.cpp's converters")
        return arch


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``; ModelLoadError when it is missing or not a readable GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        blob = np.memmap(path, dtype=np.uint8, mode="r")
        return _parse(path, blob)
    except ModelLoadError:
        raise
    except (ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc!r})") from exc


def _parse(path: Path, blob: np.ndarray) -> GGUFFile:
    # The header is parsed here rather than by gguf.GGUFReader, which builds a numpy array per
    # array element: ~10 s for a 49k-token vocabulary, against ~0.1 s this way.
    buffer = memoryview(blob)
    if bytes(buffer[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic at its start)")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} (or a big-endian file); kvserve "
                             "reads little-endian GGUF v2 and v3 (re-convert with a current "
                             "llama.cpp)")
    cursor = _Cursor(buffer, 24)
    metadata = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar(_U32))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar(_U64) for _ in range(cursor.scalar(_U32))]
        infos.append((name, GGMLQuantizationType(cursor.scalar(_U32)), dims,
                      cursor.scalar(_U64)))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, ggml_type, dims, offset in infos:
        shape = tuple(reversed(dims))  # GGUF lists dims innermost first
        block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block_elems * block_bytes
        begin = data_start + offset
        if shape[-1] % block_elems or begin + rows * row_bytes > len(blob):
            raise ModelLoadError(f"{path}: tensor {name} ({ggml_type.name} {list(shape)}) "
                                 "does not fit the file; it is truncated or corrupt")
        data = blob[begin:begin + rows * row_bytes].reshape(rows, row_bytes)  # [rows, row_bytes]
        tensors[name] = TensorRecord(name, ggml_type, shape, data)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_SCALARS = {_U8: "<B", _I8: "<b", _U16: "<H", _I16: "<h", _U32: "<I", _I32: "<i", _F32: "<f",
            _BOOL: "<?", _U64: "<Q", _I64: "<q", _F64: "<d"}
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads GGUF's little-endian values from ``buffer`` at ``pos``, advancing it."""

    def __init__(self, buffer: memoryview, pos: int) -> None:
        self.buffer = buffer
        self.pos = pos

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buffer, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return str(self.buffer[start:self.pos], "utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STR:
            return self.string()
        if kind != _ARR:
            return self.scalar(kind)
        item_kind, count = self.scalar(_U32), self.scalar(_U64)
        if item_kind in _SCALARS:
            dtype = np.dtype(_SCALARS[item_kind])
            items = np.frombuffer(self.buffer, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return items.tolist()
        return [self.value(item_kind) for _ in range(count)]
