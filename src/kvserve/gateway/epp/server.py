"""The Endpoint Picker's servers on one event loop: Envoy's ext_proc service and gRPC health
(`liveness`, `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`) on the gRPC port, and
`/metrics` (the proxy's names) and `/health` over HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.gateway.core.tenancy import has_bearer
from kvserve.gateway.epp.exchange import Exchange, Picker
from kvserve.wire.http import error_body

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """One `Exchange` per ext_proc stream (one HTTP request); the stream's end closes it, so a
    client that leaves (Envoy cancels the stream) releases its slot too."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for request in requests:
                for answer in await exchange.handle(request):
                    yield answer
        finally:
            exchange.close()


class Readiness:
    """Keeps `readiness` and the ext_proc service SERVING while some worker is healthy."""

    def __init__(self, picker: Picker, servicer: health.aio.HealthServicer) -> None:
        self.picker = picker
        self.servicer = servicer
        self.ready: bool | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def is_ready(self) -> bool:
        return bool(self.picker.fleet.pool.serving(time.monotonic()))

    async def update(self) -> None:
        ready = self.is_ready()
        if ready != self.ready:
            self.ready = ready
            status = SERVING if ready else NOT_SERVING
            for service in (READINESS, EXT_PROC_SERVICE):
                await self.servicer.set(service, status)
            log.info("kvserve epp: %s", "ready" if ready else "not ready: no healthy worker")

    def on_scraped(self) -> None:
        """After each scrape (sync): schedule the update."""
        task = asyncio.get_running_loop().create_task(self.update())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def http_app(picker: Picker, metrics_key: str | None) -> FastAPI:
    """`/metrics` (guarded by `metrics_key` when given) and `/health`."""
    app = FastAPI(title="kvserve epp")
    fleet = picker.fleet

    @app.get("/health")
    async def health_route() -> Response:
        now = time.monotonic()
        healthy = sum(1 for v in fleet.pool.views(now) if v.healthy)
        return JSONResponse({"status": "ok" if healthy else "no healthy worker",
                             "healthy_workers": healthy, "workers": len(fleet.pool.workers)},
                            200 if healthy else 503)

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        if metrics_key is not None and not has_bearer(request.headers, metrics_key):
            return Response(error_body(401, "/metrics needs the EPP's --metrics-key: send "
                                       "'Authorization: Bearer <key>'", "authentication_error"),
                            401, media_type="application/json")
        return Response(generate_latest(fleet.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def serve(picker: Picker, host: str, grpc_port: int, http_port: int,
                metrics_key: str | None = None) -> None:
    """Run until the HTTP server is told to stop (SIGINT/SIGTERM); then stop gRPC, giving
    open streams a few seconds."""
    fleet = picker.fleet
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    await checks.set(LIVENESS, SERVING)
    for service in (READINESS, EXT_PROC_SERVICE):
        await checks.set(service, NOT_SERVING)
    readiness = Readiness(picker, checks)
    fleet.on_scraped.append(readiness.on_scraped)
    address = f"{host}:{grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address} for gRPC: is the port taken?")
    await fleet.start()
    await readiness.update()
    await server.start()
    config = uvicorn.Config(http_app(picker, metrics_key), host=host, port=http_port,
                            log_level="warning")
    try:
        await uvicorn.Server(config).serve()
    finally:
        await checks.enter_graceful_shutdown()
        await server.stop(5.0)
        await fleet.stop()
