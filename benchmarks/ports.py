"""Loopback ports for the servers that tests and harnesses start, chosen below the kernel's
ephemeral range.

A port bound to 0 and released comes from the ephemeral range (ip_local_port_range), which every
outgoing connection and every other bind to port 0 draws from too: the gloo sockets of a
tensor-parallel worker, clients, another test process's servers. A server given such a port
sometimes lost it before it could bind ("address already in use"), and a whole module's fleet
failed with it. Ports below that range are never handed out implicitly, so only another explicit
choice could take one, and the choice here is random and checked free.

A port checked free is not bound yet: the server that gets it binds seconds later, once its
process has started. So a port is handed out once per process, and each pytest-xdist worker
(and a harness a test runs, which inherits its worker's name) draws from its own slice of
the range: two workers, or two servers of one, never race for one port (a TP worker's fixture
once lost its port that way; the chaos harness's worker once lost its KV-events replay port)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path

_RANDOM = random.SystemRandom()  # not the `random` state a test may seed: two processes differ
_LOWEST = 10000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError):
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    return 0


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def worker_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share [low, high) of the ports [low, high): worker gwK of N
    takes the K-th of N equal slices (the whole range outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count < 2:
        return low, high
    index = int(worker[2:]) % count
    size = (high - low) // count
    return low + index * size, low + (index + 1) * size


def free_port() -> int:
    """A free loopback port outside the ephemeral range where there is room below it (in this
    worker's slice, and not handed out before by this process), else one the kernel hands out
    (bound to port 0, then released)."""
    low, high = worker_slice(_LOWEST, _ephemeral_low())
    if high - low >= 1000:
        for _ in range(100):
            port = _RANDOM.randrange(low, high)
            if port not in _handed_out and _is_free(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
