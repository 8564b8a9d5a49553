"""Long polling of `/kv/events`: readers wait on the event loop until the engine thread appends.

A reader takes `current()` first, then checks the log, then waits on what it took: an append
between the check and the wait has already set that event (the engine thread schedules `wake`
on the loop after the log's sequence number moved), so no append is missed.
"""

from __future__ import annotations

import asyncio
import contextlib


class EventWaiters:
    """One broadcast per append, from any thread, to every reader waiting on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        """The event the next append sets (call on the loop)."""
        return self._event

    def notify_threadsafe(self) -> None:
        """Wake every reader (from the engine thread). Harmless once the loop has closed."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed, whichever first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
