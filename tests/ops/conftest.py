"""Ops fixtures: a tiny random checkpoint and, started together once for the session (they
load in parallel), the live servers every ops test reads:

- a healthy worker behind a prefix_hash gateway, with one request sent through so every
  histogram has samples;
- a worker with the planted leak of tests/ops/leaky_worker.py;
- two workers with small KV caches (48 blocks of 16 tokens) behind a round_robin gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config
from tests.ops.processes import Server, fleet


@dataclass(frozen=True)
class Servers:
    worker: Server
    gateway: Server
    leaky: Server
    small_workers: list[Server]
    round_robin: Server


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ops-ckpt") / "tiny-llama",
                                   base_config(), seed=0)


@pytest.fixture(scope="session")
def servers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with fleet(checkpoint, tmp_path_factory.mktemp("ops-servers")) as started:
        (worker,) = started.workers(1, ["--num-kv-blocks", "512"], wait=False)
        (leaky,) = started.workers(1, ["--num-kv-blocks", "128"], leaky=True, wait=False)
        small = started.workers(2, ["--num-kv-blocks", "48"], wait=False)
        started.wait_ready([worker, leaky, *small])
        gateway = started.gateway([worker], ["--policy", "prefix_hash"], wait=False)
        round_robin = started.gateway(small, ["--policy", "round_robin"], wait=False)
        started.wait_gateways([gateway, round_robin])
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=60.0,
                              headers={"X-Tenant-Id": "team-a"},
                              json={"prompt": list(range(5, 45)), "max_tokens": 4,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text
        yield Servers(worker, gateway, leaky, small, round_robin)
