"""A coroutine run every few seconds as one background task of the gateway's event loop."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod

log = logging.getLogger(__name__)


class Periodic(ABC):
    """Runs `tick()` (a subclass's) every `interval_s` from `start()` until `stop()`. A tick that
    raises is logged with its traceback and counted (`num_failed_ticks`), and the next one runs:
    a loop that died with its tick would freeze what it keeps (the scraper's: every worker's
    health, so a restarted worker would never be readmitted)."""

    interval_s: float
    num_failed_ticks: int = 0
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
            try:
                await self.tick()
            except Exception:
                self.num_failed_ticks += 1
                log.exception("kvserve gateway: %s's round failed; the next runs in %.1fs",
                              type(self).__name__, self.interval_s)
            await asyncio.sleep(self.interval_s)
