"""Server fixtures: a tiny random Llama checkpoint and real `kvserve serve` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config
from tests.server.harness import ADMIN_KEY, ServerProcess

API_KEY = "test-secret-key"

StartServer = Callable[..., ServerProcess]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GQA Llama with the writer's default tokenizer (it has a chat template)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "tiny-llama",
                                   base_config(), seed=7)


@pytest.fixture(scope="session")
def start_server(checkpoint: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """Start a healthy server with extra flags; every one started is stopped at session end."""
    started: list[ServerProcess] = []
    work_dir = tmp_path_factory.mktemp("servers")

    def start(flags: Sequence[str] = (), api_key: str | None = None,
              admin_key: str | None = ADMIN_KEY) -> ServerProcess:
        server = ServerProcess(checkpoint, work_dir, flags, api_key=api_key,
                               admin_key=admin_key)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:  # drain them all at once, then wait
        server.interrupt()
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: StartServer) -> ServerProcess:
    """The shared worker with default admission limits and no API key."""
    return start_server()


@pytest.fixture(scope="session")
def auth_server(start_server: StartServer) -> ServerProcess:
    """A worker that requires `API_KEY` on /v1 and /debug routes."""
    return start_server(api_key=API_KEY)
