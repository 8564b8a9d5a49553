"""A coroutine run every few seconds as one background task of the gateway's event loop."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod


class Periodic(ABC):
    """Runs `tick()` (a subclass's) every `interval_s` from `start()` until `stop()`. A tick
    must not raise: the loop would die with it."""

    interval_s: float
    _task: asyncio.Task[None] | None = None

    @abstractmethod
    async def tick(self) -> None:
        """One round of the periodic work."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)
