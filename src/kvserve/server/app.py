"""The FastAPI app: thin routes over `Serving`, OpenAI errors, metrics, health, /debug/kv."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.runtime import AsyncEngine, EngineDeadError
from kvserve.server.cache_routes import add_cache_routes
from kvserve.server.chat_formatting import ChatFormatter
from kvserve.server.debug import kv_report
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.event_waiters import EventWaiters, wait_for_event
from kvserve.server.formatting import CompletionFormatter
from kvserve.server.kv.prefill import PrefillRequest, PrefillService
from kvserve.server.kv.publisher import ZmqKVEventPublisher
from kvserve.server.kv.pull import KVPuller
from kvserve.server.limits import BodySizeLimit, EchoRequestId
from kvserve.server.lora_routes import adapter_cards, add_lora_routes
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.serving import (
    SSE_DONE,
    Call,
    Serving,
    failure_of,
    sse,
    sse_error,
    unless_client_leaves,
)
from kvserve.server.settings import ServerSettings, WorkerRole
from kvserve.server.structured import structured_output
from kvserve.server.tools.calls import plan_tools
from kvserve.server.trust import SaltTrust
from kvserve.server.vllm.routes import add_vllm_routes, model_card
from kvserve.wire.http import ADMIN_KEY_HEADER, PREFILL_URL_HEADER


def _check_key(request: Request, expected: str | None, what: str = "API key") -> None:
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise APIError(401, f"missing or wrong {what}: send 'Authorization: Bearer <key>'",
                       err_type="authentication_error")


def _check_stops(body: CompletionRequest | ChatCompletionRequest,
                 settings: ServerSettings) -> None:
    error = body.stop_limits_error(settings.max_stop_sequences, settings.max_stop_chars)
    if error is not None:
        raise APIError(400, error, param="stop")


MAX_EVENTS_WAIT_S = 30.0


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `engine` (started by the app's lifespan, drained on shutdown)."""
    settings = settings or ServerSettings()
    model_name = engine.info.model_name
    tokenizer = engine.tokenizer
    metrics = ServerMetrics(engine, model_name)
    role = settings.role
    admin_key = settings.admin_key  # never the API key: tenants hold that one
    trust = SaltTrust(settings.trusted_salt_key, settings.untrusted_salt, metrics.registry)
    puller = (KVPuller(engine, metrics.transfer, admin_key, settings.kv_transfer_timeout_s)
              if role is WorkerRole.DECODE else None)
    serving = Serving(engine, model_name, metrics, settings, trust, puller)
    prefill = PrefillService(engine, metrics.transfer) if role is WorkerRole.PREFILL else None

    waiters: list[EventWaiters] = []  # set by the lifespan, on the serving loop
    # Opened here, not in the lifespan, so a bad endpoint fails create_app (ValueError).
    publisher = (ZmqKVEventPublisher(settings.kv_events)
                 if settings.kv_events is not None and settings.kv_events.is_enabled else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        waiters.append(EventWaiters(asyncio.get_running_loop()))
        engine.kv_events.set_listener(waiters[0].notify_threadsafe)
        if publisher is not None:
            engine.kv_events.set_publisher(publisher.publish)
        if not engine.is_running and engine.error is None:
            engine.start()
        yield
        engine.kv_events.set_listener(None)
        engine.shutdown(drain_timeout_s=settings.drain_timeout_s)
        if publisher is not None:
            engine.kv_events.set_publisher(None)
            publisher.close()
        if puller is not None:
            await puller.close()

    docs = settings.enable_api_docs  # the route list is nobody's business by default
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(EchoRequestId)
    install_error_handlers(app)
    started = int(time.time())

    def require_api_key(request: Request) -> None:
        _check_key(request, settings.api_key)

    def require_admin_key(request: Request) -> None:
        if admin_key is None:
            raise APIError(404, f"{request.url.path} exists only on a worker started with "
                           "--admin-key (or KVSERVE_ADMIN_KEY)", err_type="not_found_error")
        _check_key(request, admin_key, "admin key")

    add_vllm_routes(app, tokenizer, model_name, engine.info.limits.max_model_len, require_api_key)
    add_lora_routes(app, engine, require_admin_key)
    add_cache_routes(app, engine, require_admin_key)
    if publisher is not None and engine.lora is not None:
        publisher.adapter_names = engine.lora.name_of

    def pull_source(raw: Request) -> str | None:
        """The prefill worker the gateway named for this request, or None. Honoured only on a
        decode worker and with the admin key (a client can never make a worker fetch)."""
        url = raw.headers.get(PREFILL_URL_HEADER)
        if url is None:
            return None
        if puller is None:
            raise APIError(400, f"this worker is --role {role.value}: it does not pull KV; "
                           "send X-KVServe-Prefill-Url only to --role decode workers")
        given = raw.headers.get(ADMIN_KEY_HEADER, "")
        if admin_key is None or not hmac.compare_digest(given.encode(), admin_key.encode()):
            raise APIError(403, "X-KVServe-Prefill-Url needs the worker's admin key in "
                           "X-KVServe-Admin-Key (the gateway's --admin-key)",
                           err_type="permission_error")
        if not url.startswith(("http://", "https://")):
            raise APIError(400, f"X-KVServe-Prefill-Url must be an http(s) URL, got {url!r}")
        return url.rstrip("/")

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok", "role": role.value})
        return JSONResponse({"status": "engine stopped", "error": repr(engine.error),
                             "role": role.value}, 503)

    @app.post("/kv/prefill", dependencies=[Depends(require_admin_key)])
    async def kv_prefill(body: PrefillRequest, raw: Request) -> Response:
        """A prompt's KV as frames (kvserve.server.kv.prefill), on a prefill worker."""
        if prefill is None:
            raise APIError(404, f"this worker is --role {role.value}; /kv/prefill is served by "
                           "--role prefill workers", err_type="not_found_error")
        return await prefill.respond(body, raw)

    @app.get("/metrics")
    async def prometheus(raw: Request) -> Response:
        _check_key(raw, settings.metrics_key, "metrics key (--metrics-key)")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [model_card(
            model_name, str(engine.info.model_path or model_name), started,
            engine.info.limits.max_model_len)] + adapter_cards(
                engine.lora, model_name, started, engine.info.limits.max_model_len)}

    @app.get("/kv/events", dependencies=[Depends(require_admin_key)])
    async def kv_events(after: int = 0, limit: int = 4096, wait: float = 0.0) -> dict[str, object]:
        """The KV cache's events numbered above `after` (kvserve.runtime.kv_event_log) as JSON,
        for readers outside the gateway: an operator's or an external indexer's look at what
        this worker caches, and the tests that check the gateway's index against it. The
        gateway follows the ZMQ stream (`--kv-events-config`), as it does vLLM's, never this
        route. With `wait` > 0 and nothing new, the answer waits up to `wait` seconds for an
        event (long polling)."""
        if after < 0 or not 1 <= limit <= 65_536 or not 0.0 <= wait <= MAX_EVENTS_WAIT_S:
            raise APIError(400, "'after' must be >= 0, 'limit' in [1, 65536] and 'wait' in "
                           f"[0, {MAX_EVENTS_WAIT_S:g}] seconds")
        log = engine.kv_events
        if wait > 0 and waiters:
            appended = waiters[0].current()  # taken before the check: see event_waiters
            if log.last_seq <= after:
                await wait_for_event(appended, wait)
        return log.since(after, limit).as_dict()

    @app.get("/debug/kv", dependencies=[Depends(require_admin_key)])
    async def debug_kv() -> dict[str, object]:
        return await engine.call(kv_report)

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported; put the text in the prompt",
                           param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        _check_stops(body, settings)
        # echo with max_tokens 0 scores the prompt alone (loglikelihood evaluations): one
        # token is sampled, as the engine always does, and not shown.
        generate = not (body.echo and body.max_tokens == 0)
        scored = body.prompt_logprobs
        if scored is None and body.echo and body.logprobs is not None:
            scored = body.logprobs  # the echoed prompt's logprobs, as vLLM
        params = body.sampling_params(body.max_tokens if generate else 1, body.logprobs,
                                      prompt_logprobs=scored)
        constraint = structured_output(body)
        if constraint is not None:
            params = dataclasses.replace(params, structured=constraint)
        prompts = body.prompts()
        pull_from = pull_source(raw)
        call = serving.begin(raw, body.model, body.cache_salt)
        cache_salt = call.cache_salt
        fmt = CompletionFormatter(tokenizer, call.request_id, call.created, model_name,
                                  params.n, body.logprobs is not None, body.echo, generate)
        if not body.stream:
            outputs = await serving.collect(raw, call, prompts, params, cache_salt, pull_from)
            return JSONResponse(fmt.whole(outputs))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = serving.stream(call, prompts, params, cache_salt, pull_from)
        first = await _first_or_error(events, raw, call)

        async def body_stream() -> AsyncIterator[str]:
            finals = {}
            pending = [first] if first is not None else []
            try:
                async for idx, output in _chain(pending, events):
                    if output.finished and (error := failure_of([output])) is not None:
                        yield sse_error(call, error)
                        await events.aclose()
                        return
                    chunk = fmt.chunk(idx, output)
                    if chunk is not None:
                        yield sse(chunk)
                    if output.finished:
                        finals[idx] = output
            except EngineDeadError as exc:
                yield _sse_engine_dead(call, exc)
                return
            if include_usage:
                yield sse(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
            yield SSE_DONE

        return StreamingResponse(body_stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_stops(body, settings)
        want_logprobs = body.logprobs
        params = body.sampling_params(body.effective_max_tokens,
                                      (body.top_logprobs or 0) if want_logprobs else None)
        constraint = structured_output(body)
        tools = plan_tools(body.tools, body.tool_choice, settings.tools,
                           body.parallel_tool_calls)
        if tools is not None and tools.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {tools.mode!r} forces the output's form: "
                               "send it without response_format or guided_*",
                               param="response_format")
            constraint = tools.constraint
        if constraint is not None:
            params = dataclasses.replace(params, structured=constraint)
        messages = [m.as_template_message() for m in body.messages]
        prompt = tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                       tools=body.tools)
        pull_from = pull_source(raw)
        call = serving.begin(raw, body.model, body.cache_salt)
        cache_salt = call.cache_salt
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = ChatFormatter(tokenizer, call.request_id, call.created, model_name, want_logprobs,
                            tools, usage_chunk=include_usage)
        if not body.stream:
            (output,) = await serving.collect(raw, call, [prompt], params, cache_salt,
                                              pull_from)
            return JSONResponse(fmt.whole(output))
        events = serving.stream(call, [prompt], params, cache_salt, pull_from)
        first = await _first_or_error(events, raw, call)

        async def body_stream() -> AsyncIterator[str]:
            final = None
            pending = [first] if first is not None else []
            try:
                async for _, output in _chain(pending, events):
                    if output.finished and (error := failure_of([output])) is not None:
                        yield sse_error(call, error)
                        await events.aclose()
                        return
                    for chunk in fmt.chunks(output):
                        yield sse(chunk)
                    if output.finished:
                        final = output
            except EngineDeadError as exc:
                yield _sse_engine_dead(call, exc)
                return
            if include_usage and final is not None:
                yield sse(fmt.usage_chunk(final))
            yield SSE_DONE

        return StreamingResponse(body_stream(), media_type="text/event-stream")

    return app


async def _first_or_error(events, raw: Request, call: Call):  # type: ignore[no-untyped-def]
    """Pull the first event before the response starts, so a refused request is still a 4xx
    (and one the client's deadline ended before its first token a 504).

    A client that leaves meanwhile (its request queued behind a full batch, or in its prefill)
    aborts the request at once, freeing its place and blocks: nothing reads the response yet,
    so without this watch the engine would compute a prompt nobody waits for, which is what
    turns clients that time out and resend into a retry storm."""
    try:
        first = await unless_client_leaves(raw, asyncio.ensure_future(_next(events)),
                                           "client disconnected before the first token")
    except StopAsyncIteration:
        return None
    if first[1].finished:
        try:
            call.check_timed_out([first[1]])
            call.check_failed([first[1]])
        except APIError:
            await events.aclose()  # ends its tasks now, not when collected
            raise
    return first


async def _next(events):  # type: ignore[no-untyped-def]
    return await events.__anext__()


def _sse_engine_dead(call: Call, exc: EngineDeadError) -> str:
    """The error event that ends a stream whose engine stopped mid-way (a failed
    tensor-parallel group): the error names the cause, instead of a dropped connection."""
    return sse_error(call, f"the engine is not running: {exc}")


async def _chain(pending, events):  # type: ignore[no-untyped-def]
    for item in pending:
        yield item
    async for item in events:
        yield item
