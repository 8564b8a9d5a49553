"""The proxied OpenAI routes (`POST /v1/completions`, `/v1/chat/completions`), served on plain
ASGI: every request the fleet serves passes here, so it skips the web framework's routing,
middleware and per-response task group, which cost the gateway more CPU than the routing
itself (the other routes stay on FastAPI, `app.py`).

Contract, per request:
- bad input is a 4xx from the gateway itself (413 past `max_body_bytes`, 400 for JSON that is
  not an object, 405 for another method), and reaches no worker;
- a client that leaves at any point, queued for admission, waiting for the first token or
  mid-stream, cancels the request: the upstream connection closes, so the worker aborts it and
  frees its blocks, and the admission slot is returned;
- a worker that fails mid-stream gives the client an error event and the end marker, never a
  hang; `x-request-id` is echoed on every answer, and a worker's answer carries the prompt
  tokens the policy expected it to have cached (`forward.PREDICTED_CACHED_HEADER`);
- a client that says how long it waits (`kvserve.client_timeout`) is answered by then: a
  worker that has not started answering by its deadline is closed (freeing its blocks) and the
  client gets a 504, or an error event where the stream had begun; each first byte, and each
  client that left before one, tells the admission's latency limit whether the fleet answers in
  time;
- a resend of a request not yet answered (the same tenant, path and body bytes, after a 429, a
  504 or a client timeout) queues for admission in the place its first send took
  (`seniority.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.client_timeout import BadTimeout, client_timeout_s, refusals_spend_retries
from kvserve.gateway.core.adapters import AdapterCatalog
from kvserve.gateway.core.lifecycle import Dispatch
from kvserve.gateway.core.pipeline import NoHealthyWorker
from kvserve.gateway.core.prepare import Prepared, Refused, prepare_request
from kvserve.gateway.core.seniority import Seniority
from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.fleet.admission import Admission, Saturated
from kvserve.gateway.fleet.build import note_arrival
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.text_capacity import TextCapacity
from kvserve.gateway.fleet.token_source import ExactKeys
from kvserve.gateway.fleet.upstream_http import UpstreamError
from kvserve.gateway.proxy.forward import (
    Forwarder,
    NoWorkerAvailable,
    Upstream,
)
from kvserve.wire.http import PREDICTED_CACHED_HEADER, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"


@dataclass(slots=True)
class _Reply:
    """A whole answer the gateway gives itself (an error, or a worker's non-streamed body)."""

    status: int
    body: bytes
    content_type: bytes = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


class _TooLarge(Exception):
    pass


@dataclass(slots=True)
class _Budget:
    """One request's time before its dispatch exists: when it arrived and its client's
    timeout (None: not said); then its dispatch (`core.lifecycle.Dispatch`), from admission."""

    started: float
    timeout_s: float | None
    key: bytes = b""  # recognises a resend of the same request (`seniority.request_key`)
    dispatch: Dispatch | None = None

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.started + self.timeout_s

    def left_s(self) -> float | None:
        """Seconds from now to the deadline (negative once passed); None without one."""
        deadline = self.deadline
        return None if deadline is None else deadline - time.monotonic()

    def expired_message(self) -> str:
        return (f"the worker did not start answering within the client's timeout of "
                f"{self.timeout_s:g} s; the request was cancelled")


def _error(status: int, message: str, err_type: str = "invalid_request_error",
           retry_after: str | None = None) -> _Reply:
    extra = ((b"retry-after", retry_after.encode()),) if retry_after else ()
    return _Reply(status, error_body(status, message, err_type), JSON, extra)


class _ClientWatch:
    """Cancels the request's task when the client disconnects, until `done()`. The server's
    `receive` also reports a disconnect once the response is complete, so the task must call
    `done()` without suspending after its last send (it does: `ProxyEndpoint._serve`)."""

    def __init__(self, receive: Receive) -> None:
        self.left = False
        self._active = True
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._active and self._task is not None:
            self.left = True
            self._task.cancel()

    def done(self) -> None:
        self._active = False
        self._watcher.cancel()


@dataclass(slots=True)
class ProxyEndpoint:
    """Serves the proxied routes for one gateway; `__call__` is an ASGI application for an
    HTTP scope whose path is in PROXIED_PATHS."""

    forwarder: Forwarder
    admission: Admission
    metrics: GatewayMetrics
    tenancy: Tenancy
    keys: ExactKeys
    capacity: TextCapacity | None
    max_body_bytes: int
    ttft_target_s: float | None = None  # a first byte later than this is late, timeout or not
    seniority: Seniority | None = field(default_factory=Seniority)  # None: queue by arrival
    worker_api_key: str | None = None  # replaces clients' keys when the gateway checks them
    trusted_salt_key: str | None = None  # proves to workers that a salt is the gateway's
    adapters: AdapterCatalog | None = None  # which LoRA adapter a request runs under

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        request_id = headers.get("x-request-id")
        echo = ((b"x-request-id", request_id.encode("latin-1")),) if request_id else ()
        if scope["method"] != "POST":
            await _send_reply(send, _Reply(405, error_body(405, f"{scope['path']} takes POST"),
                                           JSON, ((b"allow", b"POST"),)), echo)
            return
        try:
            raw = await _read_body(receive, self.max_body_bytes)
        except _TooLarge:
            await _send_reply(send, _error(413, "request body exceeds "
                                                f"{self.max_body_bytes} bytes"), echo)
            return
        if raw is None:  # the client left before sending its body
            return
        try:
            timeout_s = client_timeout_s(headers)
        except BadTimeout as exc:
            await _send_reply(send, _error(400, str(exc)), echo)
            return
        budget = _Budget(started, timeout_s)
        watch = _ClientWatch(receive)
        try:
            await self._serve(scope["path"], raw, headers, budget, send, echo)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watch.left or (task is not None and task.uncancel() > 0):
                raise
            # the client left: its upstream request is closed, nothing to answer
        finally:
            watch.done()

    async def _serve(self, path: str, raw: bytes, headers: dict[str, str], budget: _Budget,
                     send: Send, echo: tuple[tuple[bytes, bytes], ...]) -> None:
        admitted = await self._admit(path, raw, headers, budget)
        if isinstance(admitted, _Reply):
            await _send_reply(send, admitted, echo)
            return
        prepared, dispatch = admitted
        try:  # the one place an admitted request's slot is released, however it ends
            opened = await self._open(path, prepared, budget, dispatch)
            if not isinstance(opened, _Reply):
                await self._answer(opened, send, budget, echo)
                return
        except asyncio.CancelledError:
            dispatch.release(time.monotonic(), client_left=True)
            raise
        finally:
            dispatch.release(time.monotonic())
        await _send_reply(send, opened, echo)  # the gateway's own answer, its slot freed

    async def _answer(self, upstream: Upstream, send: Send, budget: _Budget,
                      echo: tuple[tuple[bytes, bytes], ...]) -> None:
        """Relay the worker's open response to the client, whole or streamed."""
        try:
            content_type = upstream.response.headers.get("content-type", "application/json")
            status = upstream.response.status_code
            predicted = upstream.predicted_cached_tokens
            extra = echo if predicted is None else (
                (PREDICTED_CACHED_HEADER.encode(), b"%d" % predicted), *echo)
            if not content_type.startswith("text/event-stream"):
                try:
                    async with asyncio.timeout(budget.left_s()):
                        content = await upstream.read()
                except TimeoutError:
                    self.metrics.deadline_expired.labels("response").inc()
                    reply = _error(504, budget.expired_message(), "timeout")
                except UpstreamError as exc:
                    reply = _error(502, f"worker {upstream.worker_url} failed mid-response: "
                                   f"{type(exc).__name__}", "upstream_error")
                else:
                    reply = _Reply(status, content, content_type.encode("latin-1"))
                    self._served(budget)
                self._first_byte(budget)
                await _send_reply(send, reply, extra)
                return
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", content_type.encode("latin-1")), *extra]})
            await self._relay(upstream, send, budget)
        finally:
            # Before anything can suspend (and before the slot's release, which follows at
            # once): once the response is complete the client watch may cancel this task at
            # its next suspension (`_ClientWatch`).
            await upstream.close()  # never suspends

    def _first_byte(self, budget: _Budget) -> None:
        """The answer started (or the gateway gave up waiting for it): tell admission."""
        assert budget.dispatch is not None
        budget.dispatch.first_byte(time.monotonic())

    def _served(self, budget: _Budget) -> None:
        """A worker answered: the same request sent again is a new one."""
        if self.seniority is not None:
            self.seniority.served(budget.key)

    async def _relay(self, upstream: Upstream, send: Send, budget: _Budget) -> None:
        """Pass an SSE stream through, then end the response. A worker that dies mid-stream,
        or sends nothing before the client's deadline, gives the client an error event and
        the end marker."""
        error: dict[str, Any] | None = None
        chunks = upstream.iter_raw()
        try:
            try:
                async with asyncio.timeout(budget.left_s()):
                    first = await anext(chunks, None)
            except TimeoutError:
                self.metrics.deadline_expired.labels("first_token").inc()
                error = {"message": budget.expired_message(), "type": "timeout", "code": 504}
                first = None
            self._first_byte(budget)
            if first is not None:
                self._served(budget)
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            error = {"message": f"worker {upstream.worker_url} failed mid-stream "
                     f"({type(exc).__name__}); retry the request", "type": "upstream_error",
                     "code": 502}
        finally:
            await chunks.aclose()
        if error is not None:
            event = {"error": {**error, "param": None}}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()})
        await send({"type": "http.response.body", "body": b""})

    async def _admit(self, path: str, raw: bytes, headers: dict[str, str],
                     budget: _Budget) -> tuple[Prepared, Dispatch] | _Reply:
        """The request prepared, holding an admission slot, as a dispatch; or the gateway's
        own answer."""
        try:
            prepared = prepare_request(path, raw, headers, self.tenancy, self.keys.keyer,
                                       self.worker_api_key, self.trusted_salt_key,
                                       self.adapters)
        except Refused as exc:
            return _error(exc.status, exc.message, exc.err_type)
        budget.key, since = note_arrival(prepared, path, raw, budget.started, self.capacity,
                                         self.keys.keyer is None, self.seniority, self.metrics)
        try:
            # An SDK client counts a 429 as one of its few retries: it waits its turn.
            slot = await self.admission.admit(
                budget.deadline, since, refuse_on_arrival=not refusals_spend_retries(headers))
        except Saturated as exc:
            self.metrics.rejections.labels(exc.reason).inc()
            return _error(429, f"the fleet is saturated ({exc.reason}); retry after "
                          f"{exc.retry_after_s}s", "rate_limit_error", str(exc.retry_after_s))
        budget.dispatch = self.forwarder.dispatch(
            prepared.route, budget.started, time.monotonic(), budget.deadline,
            self.ttft_target_s, slot)
        return prepared, budget.dispatch

    async def _open(self, path: str, prepared: Prepared, budget: _Budget,
                    dispatch: Dispatch) -> Upstream | _Reply:
        """The worker's open response, or the gateway's own answer (the caller holds the
        admission slot)."""
        try:
            async with asyncio.timeout(budget.left_s()):
                return await self.forwarder.open(path, prepared.body, prepared.headers,
                                                 dispatch, budget.deadline)
        except TimeoutError:
            self._first_byte(budget)
            self.metrics.deadline_expired.labels("response").inc()
            return _error(504, budget.expired_message(), "timeout")
        except NoHealthyWorker as exc:
            self.metrics.rejections.labels("no_healthy_worker").inc()
            return _error(503, f"no healthy worker: {exc}", "service_unavailable", "1")
        except NoWorkerAvailable as exc:
            self.metrics.rejections.labels(f"upstream_{exc.status}").inc()
            if exc.body is not None:
                extra = ((b"retry-after", exc.retry_after.encode("latin-1")),) \
                    if exc.retry_after else ()
                return _Reply(exc.status, exc.body, JSON, extra)
            return _error(503, str(exc), "service_unavailable", "1")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body; None when the client disconnected first. Raises _TooLarge as soon as
    it passes `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_reply(send: Send, reply: _Reply,
                      echo: tuple[tuple[bytes, bytes], ...]) -> None:
    await send({"type": "http.response.start", "status": reply.status, "headers": [
        (b"content-type", reply.content_type), (b"content-length", b"%d" % len(reply.body)),
        *reply.headers, *echo]})
    await send({"type": "http.response.body", "body": reply.body})
