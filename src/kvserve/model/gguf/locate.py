"""Which .gguf file a model argument means: the file itself, or a directory's only one.

A directory that holds a ``config.json`` is a Hugging Face checkpoint and never a GGUF one, so
adding a .gguf beside safetensors changes nothing. Split GGUFs (``-00001-of-00003.gguf``) are
refused: llama.cpp's ``llama-gguf-split --merge`` joins them into one file.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.model.errors import ModelLoadError

_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def is_gguf(path: Path) -> bool:
    """A file whose name ends in .gguf (case-insensitive)."""
    return path.suffix.lower() == ".gguf"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names, or None when it names none (a Hugging Face directory, a
    directory without .gguf files, or a file of another kind). ModelLoadError when it is
    ambiguous (two or more .gguf files) or a split GGUF."""
    if path.is_file():
        return _checked(path) if is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and is_gguf(p))
    if len(found) > 1:
        raise ModelLoadError(f"{path}: holds {len(found)} GGUF files "
                             f"({', '.join(p.name for p in found)}); pass the one to serve as "
                             "the model path (e.g. --model DIR/NAME.gguf)")
    return _checked(found[0]) if found else None


def _checked(path: Path) -> Path:
    if _SPLIT.search(path.name):
        raise ModelLoadError(f"{path}: is one part of a split GGUF; join the parts with "
                             "llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf` and "
                             "serve OUT.gguf")
    return path
