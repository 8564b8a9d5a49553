"""Rendezvous (highest-random-weight) hashing of prefix keys over worker ids.

Each worker's weight for a key is a sha256 of (key, worker id); the key's preference order is the
workers by descending weight. Every process computes the same order with no shared state, and
adding or removing one worker among N changes the first choice of only ~1/N of the keys: those
the new worker wins, or those the removed worker held.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from kvserve.gateway.core.pipeline.base import RouteRequest, WorkerView

DEFAULT_PREFIX_BLOCKS = 4
"""Leading prefix blocks in a rendezvous key: enough to tell a tenant's agents apart, few enough
that a conversation keeps its key as it grows."""

_DOMAIN = b"kvserve.gateway.rendezvous.v1"


def rendezvous_key(
    tenant: str | None, prefix_hashes: Sequence[bytes], prefix_blocks: int = DEFAULT_PREFIX_BLOCKS
) -> bytes:
    """The 32-byte routing key of a tenant and the first `prefix_blocks` of its prefix hashes."""
    digest = hashlib.sha256(_DOMAIN)
    if tenant is None:
        digest.update(b"\xff\xff\xff\xff")
    else:
        raw = tenant.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(4, "little") + raw)
    for block_hash in prefix_hashes[:prefix_blocks]:
        digest.update(len(block_hash).to_bytes(4, "little") + block_hash)
    return digest.digest()


def rendezvous_weight(key: bytes, worker_id: str) -> int:
    """The worker's 64-bit weight for a key (the key is fixed-width, so key | id is unambiguous)."""
    digest = hashlib.sha256(key + worker_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def rendezvous_order(key: bytes, workers: Iterable[WorkerView]) -> list[WorkerView]:
    """Workers by descending weight for `key` (ties, vanishingly rare, by worker id)."""
    return sorted(workers, key=lambda w: (-rendezvous_weight(key, w.worker_id), w.worker_id))


class RendezvousOrder:
    """Pipeline order: the candidates by descending weight for the request's key (tenant and
    first `prefix_blocks` block hashes), so equal scores fall where `prefix_hash` would put
    the prefix, alike on every replica."""

    def __init__(self, prefix_blocks: int = DEFAULT_PREFIX_BLOCKS) -> None:
        self.prefix_blocks = prefix_blocks

    def order(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        key = rendezvous_key(request.tenant, request.prefix_hashes, self.prefix_blocks)
        return rendezvous_order(key, workers)
