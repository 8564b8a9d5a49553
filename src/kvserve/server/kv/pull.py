"""The decode side of disaggregated prefill: pull a prompt's KV from a prefill worker.

`KVPuller.pull` opens an import on the engine thread (tokenizes the prompt, finds the leading
full blocks this worker already holds), POSTs the rest to the prefill worker's /kv/prefill and
imports the streamed frames as they arrive: each frame's CRC32 is verified, then a batch of
blocks is reserved, written and confirmed in host slots on the engine thread, pinned until the
request is admitted. Any failure (refused, cut, corrupted, a hash that is not ours) cancels the
import and raises `KVTransferFailed`; the caller answers 502. The caller always ends the import
with `finish` (idempotent), whatever happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future

import httpx

from kvserve.runtime import AsyncEngine
from kvserve.runtime.kv_transfer import (
    ImportStart,
    cancel_import,
    import_blocks,
    open_import,
)
from kvserve.server.kv.frames import ChecksumMismatch, FrameDecoder, FrameError, FrameKind
from kvserve.server.kv.prefill import LAYOUT_HEADER
from kvserve.server.metrics import TransferMetrics


class KVTransferFailed(Exception):
    """The KV could not be pulled; the message names the prefill worker and the cause."""


class KVPuller:
    """Pulls KV for one decode worker's engine with one shared HTTP client."""

    def __init__(self, engine: AsyncEngine, metrics: TransferMetrics, admin_key: str | None,
                 timeout_s: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admin_key = admin_key
        self.timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
        self.layout = engine.info.kv_layout
        self.max_payload = engine.info.kv_payload_bytes
        self._client: httpx.AsyncClient | None = None

    async def pull(self, import_id: str, prompt: str | Sequence[int], cache_salt: str | None,
                   prefill_url: str) -> list[int]:
        """Import the prompt's KV under `import_id` (the engine request id); returns the
        prompt's token ids, to add the request with `kv_import=True`. Raises ValueError for a
        prompt the engine refuses, KVTransferFailed when the transfer fails."""
        started = time.monotonic()
        start: ImportStart = await self.engine.call(
            lambda e: open_import(e, import_id, prompt, cache_salt))
        plan = start.plan
        self.metrics.skipped_blocks.inc(plan.first_block)
        if plan.num_blocks:
            try:
                await self._receive(import_id, start, cache_salt, prefill_url)
            except ChecksumMismatch as exc:
                self.metrics.checksum_failures.inc()
                self.metrics.failed("checksum")
                raise KVTransferFailed(f"KV transfer from prefill worker {prefill_url} failed: "
                                       f"{exc}") from None
            except FrameError as exc:
                self.metrics.failed("bad_stream")
                raise KVTransferFailed(f"KV transfer from prefill worker {prefill_url} failed: "
                                       f"{exc}") from None
            except httpx.HTTPError as exc:
                self.metrics.failed("connection")
                raise KVTransferFailed(f"KV transfer from prefill worker {prefill_url} failed: "
                                       f"{type(exc).__name__}: {exc}") from None
        self.metrics.pull_seconds.observe(time.monotonic() - started)
        return list(start.token_ids)

    def finish(self, import_id: str) -> None:
        """End the import whatever happened (idempotent; never waits): a request that took it
        over released it already; otherwise its slots are returned."""
        self.engine.run_soon(lambda e: cancel_import(e, import_id))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _receive(self, import_id: str, start: ImportStart, cache_salt: str | None,
                       prefill_url: str) -> None:
        # Invariant: import commands reach the engine thread in block order, each submitted
        # before anything else for this import (the caller's `finish` comes last).
        plan = start.plan
        body = {"token_ids": list(start.token_ids), "cache_salt": cache_salt,
                "first_block": plan.first_block,
                "block_hashes": [h.hex() for h in plan.block_hashes]}
        headers = {LAYOUT_HEADER: self.layout}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        decoder = FrameDecoder(self.max_payload)
        batch: list[tuple[int, bytes, bytes]] = []
        inflight: Future[bool] | None = None
        has_room = True
        num_received = 0
        async with self._http().stream("POST", f"{prefill_url}/kv/prefill", json=body,
                                       headers=headers, timeout=self.timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:500]
                self.metrics.failed(f"http_{response.status_code}")
                raise KVTransferFailed(f"KV transfer from prefill worker {prefill_url} failed: "
                                       f"it answered {response.status_code}: {text}")
            streaming_since = time.monotonic()
            async for chunk in response.aiter_raw():
                self.metrics.bytes_received.inc(len(chunk))
                for frame in decoder.feed(chunk):
                    if frame.kind is FrameKind.ERROR:
                        raise FrameError(frame.payload.decode("utf-8", "replace"))
                    if frame.kind is FrameKind.END:
                        if frame.block_idx != plan.num_blocks or num_received != plan.num_blocks:
                            raise FrameError(f"the KV stream ended after {num_received} of "
                                             f"{plan.num_blocks} blocks (it says "
                                             f"{frame.block_idx})")
                        continue
                    num_received += 1
                    batch.append((frame.block_idx, frame.block_hash, frame.payload))
                if batch and (inflight is None or inflight.done()):
                    if inflight is not None and not await self._landed(inflight):
                        has_room = False
                        break  # no host room: the request computes the rest itself
                    inflight = self._submit(import_id, batch)
                    batch = []
            if has_room:
                decoder.finish()
        if inflight is not None and not await self._landed(inflight):
            return
        if batch and has_room:
            await self._landed(self._submit(import_id, batch))
        self.metrics.seconds.observe(time.monotonic() - streaming_since)

    def _submit(self, import_id: str, batch: list[tuple[int, bytes, bytes]]) -> Future[bool]:
        self.metrics.blocks_received.inc(len(batch))
        return self.engine.submit_call(lambda e: import_blocks(e, import_id, batch))

    @staticmethod
    async def _landed(future: Future[bool]) -> bool:
        try:
            return await asyncio.wrap_future(future)
        except ValueError as exc:  # out of order, another hash, wrong size: the import is gone
            raise FrameError(str(exc)) from None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=32))
        return self._client
