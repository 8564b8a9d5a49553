"""Fixtures for kvserve.model: tiny random HF checkpoints written with our own writer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.model import cpu_kernels, write_random_checkpoint

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


@pytest.fixture(params=["cpu_kernel", "pytorch"])
def attention_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once through kvserve's CPU kernels and once through the PyTorch
    paths (the reference); the kernel run skips where the kernel cannot be built."""
    if request.param == "pytorch":
        with cpu_kernels.disabled():
            yield request.param
        return
    if not cpu_kernels.families():
        pytest.skip("kvserve's CPU kernels are not available here (needs x86-64 with "
                    "AVX-512 or AVX2 and a C compiler)")
    yield request.param
