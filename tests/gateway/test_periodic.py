"""A periodic task's failed round is logged and counted, and the next round runs: the chaos
harness saw a gateway whose scraper loop had died stop readmitting restarted workers."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvserve.gateway.fleet.periodic import Periodic


class _FailsOnce(Periodic):
    def __init__(self) -> None:
        self.interval_s = 0.01
        self.rounds = 0

    async def tick(self) -> None:
        self.rounds += 1
        if self.rounds == 2:
            raise ValueError("a malformed /metrics page")


def test_a_failed_round_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> _FailsOnce:
        task = _FailsOnce()
        task.start()
        for _ in range(500):
            if task.rounds >= 5:
                break
            await asyncio.sleep(0.01)
        await task.stop()
        return task

    with caplog.at_level(logging.ERROR, logger="kvserve.gateway.fleet.periodic"):
        task = asyncio.run(scenario())
    assert task.rounds >= 5, task.rounds
    assert task.num_failed_ticks == 1
    assert "_FailsOnce's round failed" in caplog.text and "malformed" in caplog.text
