"""Fixtures for the proxy tests: a tiny random checkpoint, two real workers and a real gateway,
started once for the package (the pure policy tests here never touch them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from kvserve.model import write_random_checkpoint
from tests.gateway.processes import Process, running_gateway, running_workers
from tests.model.arch_configs import base_config

SALT_SECRET = "proxy-test-secret"
MakeClient = Callable[..., openai.OpenAI]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GQA Llama with the writer's default tokenizer (it has a chat template)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("gateway-ckpt") / "tiny-llama",
                                   base_config(), seed=7)


@pytest.fixture(scope="session")
def proc_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-procs")


@pytest.fixture(scope="package")
def fleet(tiny_model: Path, proc_logs: Path) -> Iterator[list[Process]]:
    """Two shared workers; tests that kill a worker start their own."""
    with running_workers(tiny_model, proc_logs, 2) as workers:
        yield workers


@pytest.fixture(scope="package")
def gateway(fleet: list[Process], proc_logs: Path) -> Iterator[Process]:
    """The shared gateway (prefix_hash) in front of `fleet`."""
    flags = ["--policy", "prefix_hash", "--salt-secret", SALT_SECRET]
    with running_gateway([w.url for w in fleet], proc_logs, flags) as gw:
        yield gw


@pytest.fixture(scope="session")
def make_client() -> MakeClient:
    """An official OpenAI client for a base URL; never retries on its own."""
    def make(url: str, **kwargs: object) -> openai.OpenAI:
        options: dict[str, object] = {"timeout": 60.0, **kwargs}
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                             **options)  # type: ignore[arg-type]
    return make


@pytest.fixture(scope="package")
def model_name(tiny_model: Path) -> str:
    return str(tiny_model)
