"""Fixtures for kvserve.model: tiny random HF checkpoints written with our own writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.model import write_random_checkpoint

from .arch_configs import ARCH_CONFIGS


@pytest.fixture(scope="session")
def arch_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every ARCH_CONFIGS entry written once per session (seeded by its position)."""
    root = tmp_path_factory.mktemp("arch")
    return {name: write_random_checkpoint(root / name, config, seed=i)
            for i, (name, config) in enumerate(ARCH_CONFIGS.items())}


@pytest.fixture(scope="session")
def llama_dir(arch_checkpoints: dict[str, Path]) -> Path:
    return arch_checkpoints["llama_gqa"]
