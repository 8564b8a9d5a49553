"""Open a .gguf file: its metadata as plain Python values and its tensors as packed byte rows.

The file is memory-mapped by ``gguf.GGUFReader``; every ``TensorRecord.data`` is a view into that
map (no copy), so opening a multi-gigabyte file costs page-table entries, not RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

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
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    metadata = {name: _value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    tensors = {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)  # [rows, row_bytes]
        tensors[tensor.name] = TensorRecord(tensor.name, GGMLQuantizationType(tensor.tensor_type),
                                            shape, data)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def _value(field: Any) -> Any:
    """A metadata field as a Python value; strings decoded as UTF-8, arrays as lists."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value
