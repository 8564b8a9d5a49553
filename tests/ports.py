"""Loopback ports for the servers tests start, chosen below the kernel's ephemeral range.

A port bound to 0 and released comes from the ephemeral range (ip_local_port_range), which every
outgoing connection and every other bind to port 0 draws from too: the gloo sockets of a
tensor-parallel worker, clients, another test process's servers. A server given such a port
sometimes lost it before it could bind ("address already in use"), and a whole module's fleet
failed with it. Ports below that range are never handed out implicitly, so only another explicit
choice could take one, and the choice here is random and checked free."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_RANDOM = random.SystemRandom()  # not the `random` state a test may seed: two processes differ
_LOWEST = 10000


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


def free_port() -> int:
    """A free loopback port outside the ephemeral range where there is room below it, else one
    the kernel hands out (bound to port 0, then released)."""
    high = _ephemeral_low()
    if high - _LOWEST >= 1000:
        for _ in range(100):
            port = _RANDOM.randrange(_LOWEST, high)
            if _is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
