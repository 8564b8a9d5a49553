"""The loopback ports tests give their servers: never one twice, each xdist worker its own."""

from __future__ import annotations

import socket

import pytest

from benchmarks import ports


def test_a_port_is_handed_out_once_per_process() -> None:
    drawn = [ports.free_port() for _ in range(200)]
    assert len(set(drawn)) == len(drawn)
    for port in drawn[:5]:  # each is free to bind now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_each_xdist_worker_draws_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(ports.worker_slice(10000, 32768))
    (low0, high0), (low1, high1) = slices
    assert low0 == 10000 and high0 == low1 and high1 <= 32768 and high0 - low0 > 10000
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    if ports._ephemeral_low() - 10000 >= 2000:
        low, high = ports.worker_slice(10000, ports._ephemeral_low())
        assert all(low <= ports.free_port() < high for _ in range(20))
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert ports.worker_slice(10000, 32768) == (10000, 32768)
