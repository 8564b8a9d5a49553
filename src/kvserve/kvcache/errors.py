"""Errors the cache raises. An expected "no" (no room) is a return value, never one of these."""

from __future__ import annotations


class CacheCorruption(RuntimeError):
    """A block a request reads was reassigned or changed under it.

    Names the request, the block, the epoch its table remembers and the block's current epoch, so
    on-call reads the cause, not a symptom.
    """

    def __init__(
        self,
        request_id: str,
        block_id: int,
        expected_epoch: int,
        actual_epoch: int,
        detail: str,
    ) -> None:
        self.request_id = request_id
        self.block_id = block_id
        self.expected_epoch = expected_epoch
        self.actual_epoch = actual_epoch
        self.detail = detail
        super().__init__(
            f"cache corruption detected: request {request_id!r} block {block_id} "
            f"(epoch seen {expected_epoch}, now {actual_epoch}): {detail}"
        )


class UnknownRequest(KeyError):
    """An operation named a request the cache does not hold (never added, or already freed)."""
