"""Fixtures for the GGUF tests: tiny files written once per session, one directory each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from .gguf_files import Vocabulary, gpt2_vocabulary, llama_vocabulary, tiny_config, write_gguf

GGUFFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def gpt2_vocab() -> Vocabulary:
    return gpt2_vocabulary()


@pytest.fixture(scope="session")
def llama_vocab() -> Vocabulary:
    return llama_vocabulary()


@pytest.fixture(scope="session")
def make_gguf(tmp_path_factory: pytest.TempPathFactory, gpt2_vocab: Vocabulary) -> GGUFFactory:
    """``make_gguf(qtype, arch=..., vocab=..., **config_overrides)`` -> path of model.gguf in a
    directory of its own; the same arguments return the same file."""
    made: dict[str, Path] = {}

    def make(qtype: T = T.F32, *, arch: str = "llama", vocab: Vocabulary | None = None,
             seed: int = 0, write_kwargs: dict[str, Any] | None = None,
             **overrides: Any) -> Path:
        vocab = vocab or gpt2_vocab
        key = repr((qtype, arch, vocab.model, vocab.pre, seed, write_kwargs,
                    sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}_{qtype.name}")
            config = tiny_config(arch, vocab_size=len(vocab.tokens), **overrides)
            made[key] = write_gguf(folder / "model.gguf", config, vocab, qtype, seed=seed,
                                   **(write_kwargs or {}))
        return made[key]

    return make
