"""Admission control: a bounded number of requests in flight, a bounded queue with a timeout.

When the fleet is saturated a request waits (up to `queue_timeout_s`, in a queue of at most
`max_queued`); past either limit the gateway answers 429 with Retry-After instead of piling load
onto workers whose clients are already timing out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Saturated(Exception):
    """No slot within the queue limits; `retry_after_s` is what to tell the client."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Admission:
    """At most `max_in_flight` requests run; up to `max_queued` wait for a slot."""

    def __init__(self, max_in_flight: int, max_queued: int, queue_timeout_s: float,
                 retry_after_s: int = 1) -> None:
        if max_in_flight < 1 or max_queued < 0 or queue_timeout_s < 0:
            raise ValueError("max_in_flight >= 1, max_queued >= 0 and queue_timeout_s >= 0")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.queued = 0
        self.rejected = 0
        self._slots = asyncio.Semaphore(max_in_flight)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the duration of a block; raises Saturated when none comes."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Take a slot (a streamed response releases it when the stream ends); raises
        Saturated when none comes within the queue limits."""
        if self._slots.locked():
            if self.queued >= self.max_queued:
                self.rejected += 1
                raise Saturated("queue full", self.retry_after_s)
            self.queued += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except TimeoutError:
                self.rejected += 1
                raise Saturated("queue timeout", self.retry_after_s) from None
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._slots.release()
