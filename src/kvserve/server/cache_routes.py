"""`POST /reset_prefix_cache`, as vLLM serves it (there only under VLLM_SERVER_DEV_MODE=1; here
behind the admin key): every cached prefix block is forgotten, in every tier, so the next
request starts cold. Benchmarks call it between runs instead of restarting a worker.

Contract: 200 with an empty body once the device pool, the host tier and the disk tier hold no
cached block (their blocks' epochs moved on; with KV events on, AllBlocksCleared is published
at once, before any later block); 409, changing nothing, while a request holds blocks, a request is
swapped out, a KV import is open or a copy between the tiers is unconfirmed (the cache's own
refusal: a held block's hash is what its request's later commits chain from)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request, Response

from kvserve.runtime import AsyncEngine
from kvserve.server.errors import APIError


def add_cache_routes(app: FastAPI, engine: AsyncEngine,
                     require_admin_key: Callable[[Request], None]) -> None:
    @app.post("/reset_prefix_cache", dependencies=[Depends(require_admin_key)])
    async def reset_prefix_cache() -> Response:
        if not await engine.call(lambda e: e.reset_prefix_cache()):
            raise APIError(409, "the prefix cache is in use (live requests: "
                           f"{engine.num_live_requests}; a request holds blocks, is swapped "
                           "out or a copy between the KV tiers is in flight): nothing was "
                           "reset; retry when the worker is idle", err_type="conflict_error")
        return Response(status_code=200)
