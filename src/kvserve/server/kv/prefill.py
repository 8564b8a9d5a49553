"""`POST /kv/prefill` (prefill role, admin key): compute a prompt's KV, stream its blocks as frames.

The decode worker sends the prompt's token ids, the cache salt, and the full blocks it wants
(`first_block` and their chained hashes: the blocks before it, it holds). The prompt runs here
as an ordinary one-token request (scheduling, prefix cache and accounting as usual); right
after the step that completes it, on the engine thread, the wanted blocks' KV is copied out and
the request is freed, so nothing stays held while the frames travel. Losing the caller during
the prefill aborts it; losing it during the stream just stops the frames.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from kvserve.engine import FinishReason, SamplingParams
from kvserve.runtime import AsyncEngine, LLMEngine, RequestOutput
from kvserve.runtime.kv_transfer import (
    ExportedBlocks,
    export_prompt_blocks,
    prompt_block_hashes,
)
from kvserve.server.errors import APIError
from kvserve.server.kv.frames import encode_block, encode_end
from kvserve.server.metrics import TransferMetrics

LAYOUT_HEADER = "x-kvserve-kv-layout"
FRAME_MEDIA_TYPE = "application/x-kvserve-kv-frames"
_DISCONNECT_POLL_S = 0.2


class PrefillRequest(BaseModel):
    """What a decode worker asks for: the KV of blocks `[first_block, first_block +
    len(block_hashes))` of the prompt `token_ids` under `cache_salt`."""

    token_ids: list[int] = Field(min_length=1)
    cache_salt: str | None = None
    first_block: int = Field(ge=0)
    block_hashes: list[str]


class PrefillService:
    """Serves /kv/prefill for one engine."""

    def __init__(self, engine: AsyncEngine, metrics: TransferMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.layout = engine.info.kv_layout

    async def respond(self, body: PrefillRequest, raw: Request) -> StreamingResponse:
        """Check the request, run the prefill, then stream the frames. Raises APIError (4xx)
        for a request this worker cannot serve, before anything is computed."""
        info = self.engine.info
        layout = raw.headers.get(LAYOUT_HEADER)
        if layout != self.layout:
            raise APIError(400, f"KV layout {layout!r} differs from this prefill worker's "
                           f"{self.layout!r}: run the same model, dtype and --block-size on "
                           "prefill and decode workers")
        bs = info.limits.block_size
        stop = body.first_block + len(body.block_hashes)
        if stop > len(body.token_ids) // bs:
            raise APIError(400, f"blocks up to {stop} asked for, but the prompt of "
                           f"{len(body.token_ids)} tokens has {len(body.token_ids) // bs} full "
                           "blocks", param="block_hashes")
        ours = prompt_block_hashes(info, body.token_ids, body.cache_salt, stop)
        if [h.hex() for h in ours[body.first_block:]] != body.block_hashes:
            raise APIError(400, "the block hashes differ from this prefill worker's: serve the "
                           "same --served-model-name and --block-size on prefill and decode "
                           "workers", param="block_hashes")
        exported = await self._prefill(body, raw, stop)
        return StreamingResponse(self._frames(exported), media_type=FRAME_MEDIA_TYPE)

    async def _prefill(self, body: PrefillRequest, raw: Request, stop: int) -> ExportedBlocks:
        box: dict[str, ExportedBlocks | None] = {}

        errors: list[str] = []

        # On the engine thread, the request's blocks still cached.
        def on_finish(llm: LLMEngine, output: RequestOutput) -> None:
            if output.outputs[0].finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
                return
            try:  # never let a failed copy take the engine loop down with it
                box["kv"] = export_prompt_blocks(llm, body.token_ids, body.cache_salt,
                                                 body.first_block, stop)
            except Exception as exc:
                errors.append(f"copying its KV out failed: {exc!r}")

        params = SamplingParams(max_tokens=1, temperature=0.0)
        request_id = f"prefill-{uuid.uuid4().hex}"

        async def run() -> None:
            async for output in self.engine.generate(request_id, body.token_ids, params,
                                                     cache_salt=body.cache_salt,
                                                     on_finish=on_finish):
                if output.finished and output.outputs[0].error:
                    errors.append(output.outputs[0].error)

        task = asyncio.ensure_future(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()  # closing the stream aborts the request: blocks freed
                    await asyncio.gather(task, return_exceptions=True)
                    raise APIError(499, "the decode worker disconnected during the prefill",
                                   err_type="client_closed_request")
            task.result()
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        exported = box.get("kv")
        if exported is None:
            detail = errors[0] if errors else "its blocks were not in the prefix cache"
            raise APIError(500, f"the prefill did not produce the prompt's KV: {detail}",
                           err_type="internal_error")
        return exported

    async def _frames(self, exported: ExportedBlocks) -> AsyncIterator[bytes]:
        bs = exported.block_size
        for offset, (block_hash, payload) in enumerate(
                zip(exported.block_hashes, exported.payloads, strict=True)):
            frame = encode_block(exported.first_block + offset, bs, block_hash, payload)
            yield frame
            self.metrics.blocks_sent.inc()
            self.metrics.bytes_sent.inc(len(frame))
        yield encode_end(len(exported.payloads))

