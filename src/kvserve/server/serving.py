"""Request lifecycle shared by the OpenAI routes: admission, deadlines, streams, disconnects.

Admission is bounded (429 + Retry-After beyond `max_waiting_requests`); every request carries the
server deadline into the engine; closing a stream or losing the client aborts the engine request,
which frees its blocks through the engine's one free path. A client that says how long it waits
for its answer to start (`kvserve.client_timeout`: the gateway's x-kvserve-timeout, the OpenAI
SDKs' read timeout) has its request ended by the engine at that deadline if no token is out by
then (streamed) or it is not done (whole), and gets a 504: nobody would read the answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from kvserve.client_timeout import BadTimeout, client_timeout_s
from kvserve.engine import FinishReason, SamplingParams
from kvserve.engine.lora import AdapterRef
from kvserve.runtime import AsyncEngine, RequestOutput
from kvserve.server.errors import APIError
from kvserve.server.kv.pull import KVPuller, KVTransferFailed
from kvserve.server.metrics import ServerMetrics, tenant_label
from kvserve.server.settings import ServerSettings
from kvserve.server.trust import SaltTrust


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request's identity: the id echoed to the client and the tenant for metrics;
    `timeout_s` / `response_deadline` (time.monotonic): the client's, when it said one."""

    request_id: str
    tenant: str
    created: int
    timeout_s: float | None = None
    response_deadline: float | None = None
    cache_salt: str | None = None  # the salt this worker accepted (kvserve.server.trust)
    lora: AdapterRef | None = None  # the LoRA adapter the request's `model` names

    def check_timed_out(self, outputs: Sequence[RequestOutput]) -> None:
        """Raise APIError 504 when the client's deadline ended every sample before a token."""
        if self.timeout_s is not None and outputs and all(
                c.finish_reason is FinishReason.TIMEOUT and not c.token_ids
                for o in outputs for c in o.outputs):
            raise APIError(504, f"no answer within the client's timeout of {self.timeout_s:g} s "
                           "(x-kvserve-timeout / x-stainless-read-timeout); the request was "
                           "dropped unanswered", err_type="timeout")

    def check_failed(self, outputs: Sequence[RequestOutput]) -> None:
        """Raise APIError 500 naming the fault when the worker ended a sample with an error
        (a corrupt KV block: its message names the block and both epochs)."""
        if (error := failure_of(outputs)) is not None:
            raise APIError(500, f"request {self.request_id!r} failed on the worker: {error}",
                           err_type="internal_server_error")


def failure_of(outputs: Sequence[RequestOutput]) -> str | None:
    """The error of the first sample that finished with FinishReason.ERROR, if any."""
    for output in outputs:
        for c in output.outputs:
            if c.finish_reason is FinishReason.ERROR:
                return c.error or "the worker ended the request with an error"
    return None


def sse_error(call: Call, error: str) -> str:
    """The SSE event that ends a stream whose request failed on the worker (the OpenAI
    client raises it as an APIError)."""
    return sse({"error": {"message": f"request {call.request_id!r} failed on the worker: "
                                     f"{error}", "type": "internal_server_error",
                          "param": None, "code": 500}})


def sse(data: object) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


class Serving:
    """Runs requests on the engine for the routes."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        metrics: ServerMetrics,
        settings: ServerSettings,
        trust: SaltTrust,
        puller: KVPuller | None = None,
    ) -> None:
        self.trust = trust
        self.engine = engine
        self.puller = puller  # decode role: pulls prompt KV from a prefill worker
        self.model_name = model_name
        self.metrics = metrics
        self.settings = settings
        self.in_flight = 0
        self.capacity = engine.info.limits.max_num_seqs + settings.max_waiting_requests

    def begin(self, raw: Request, model: str | None, cache_salt: str | None) -> Call:
        """Check the model name, the engine and who may salt (`SaltTrust`); raises APIError
        (404/503/403) otherwise.
        Admission (429) is decided when the request's stream starts."""
        lora = None
        if model is not None and model != self.model_name:
            registry = self.engine.lora
            entry = registry.entries.get(model) if registry is not None else None
            if entry is None:  # vLLM's message and type
                raise APIError(404, f"The model `{model}` does not exist.", param="model",
                               err_type="NotFoundError")
            lora = entry.ref
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", err_type="service_unavailable")
        try:
            timeout_s = client_timeout_s(raw.headers)
        except BadTimeout as exc:
            raise APIError(400, str(exc)) from None
        header_id = raw.headers.get("x-request-id")
        request_id = header_id or uuid.uuid4().hex
        accepted = self.trust.accept(raw.headers, cache_salt)
        named = accepted.tenant if self.settings.tenant_metric_labels else None
        tenant = tenant_label(named, accepted.cache_salt)
        return Call(request_id, tenant, int(time.time()), timeout_s,
                    None if timeout_s is None else time.monotonic() + timeout_s,
                    accepted.cache_salt, lora)

    async def stream(
        self,
        call: Call,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        cache_salt: str | None,
        pull_from: str | None = None,
        streamed: bool = True,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt as they come: (prompt index, output). Raises APIError (429)
        when the server is saturated and ValueError for a prompt the engine refuses, before
        anything is yielded for it. With `pull_from` (a prefill worker's URL; n = 1 only),
        each prompt's KV is pulled from there first; a failed pull is an APIError (502).
        The client's deadline bounds the first token when `streamed`, else the whole answer."""
        if pull_from is not None and call.lora is not None:
            raise APIError(400, "disaggregated prefill does not carry LoRA adapters yet: send "
                           "adapter requests to a --role both worker", param="model")
        # Check and count in one step (no await between): a flood of requests that all passed
        # the route's awaits together must not all be admitted.
        if self.in_flight >= self.capacity:
            self.metrics.refused("queue_full")
            raise APIError(429, f"the server is saturated ({self.in_flight} requests in flight); "
                           f"retry after {self.settings.retry_after_s}s",
                           err_type="rate_limit_error",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        self.in_flight += len(prompts)
        self.metrics.in_flight.labels(self.model_name).set(self.in_flight)
        deadline = first_token_deadline = None
        if self.settings.request_timeout_s is not None:
            deadline = time.monotonic() + self.settings.request_timeout_s
        if call.response_deadline is not None:
            if streamed:
                first_token_deadline = call.response_deadline
            else:
                deadline = min(deadline or math.inf, call.response_deadline)
        # (idx, output) per engine output; then idx alone once that prompt's stream ended.
        queue: asyncio.Queue[tuple[int, RequestOutput] | int | BaseException] = asyncio.Queue()

        async def pump(idx: int, prompt: str | list[int]) -> None:
            engine_id = f"{call.request_id}-{idx}-{uuid.uuid4().hex[:8]}"
            last = None
            pull = pull_from is not None and self.puller is not None and params.n == 1
            try:
                if pull:
                    assert self.puller is not None and pull_from is not None
                    try:
                        prompt = await self.puller.pull(engine_id, prompt, cache_salt, pull_from)
                    except KVTransferFailed as exc:
                        raise APIError(502, str(exc), err_type="upstream_error") from None
                async for output in self.engine.generate(engine_id, prompt, params,
                                                         cache_salt=cache_salt, lora=call.lora,
                                                         deadline=deadline, kv_import=pull,
                                                         first_token_deadline=first_token_deadline,
                                                         max_tokens_within_context=True):
                    now = time.monotonic()
                    if last is not None and any(c.new_token_ids for c in output.outputs):
                        self.metrics.observe_token_gap(now - last)
                    last = now
                    if output.finished:
                        self.metrics.observe_finished(output, call.tenant, params.max_tokens)
                    await queue.put((idx, output))
                await queue.put(idx)
            except BaseException as exc:
                await queue.put(exc)
                raise
            finally:
                self.in_flight -= 1
                self.metrics.in_flight.labels(self.model_name).set(self.in_flight)
                if pull:
                    assert self.puller is not None
                    self.puller.finish(engine_id)

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
        # Outputs are the engine's live objects, still changing on its thread while read here:
        # "finished" is decided by the end of each prompt's stream, never by re-reading an
        # output (it may turn finished between the caller's read and ours).
        done: set[int] = set()
        try:
            while len(done) < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, int):
                    done.add(item)
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(
        self,
        raw: Request,
        call: Call,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        cache_salt: str | None,
        pull_from: str | None = None,
    ) -> list[RequestOutput]:
        """Final outputs of every prompt; aborts everything if the client goes away."""
        finals: dict[int, RequestOutput] = {}

        async def run() -> None:
            async for idx, output in self.stream(call, prompts, params, cache_salt, pull_from,
                                                 streamed=False):
                if output.finished:
                    finals[idx] = output

        await unless_client_leaves(raw, asyncio.ensure_future(run()), "client disconnected")
        outputs = [finals[i] for i in range(len(prompts))]
        call.check_timed_out(outputs)
        call.check_failed(outputs)
        return outputs


async def client_left(raw: Request) -> None:
    """Return when the client disconnects (the body is already read: the next message the
    server has for this request is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(raw: Request, task: asyncio.Future[T], message: str) -> T:
    """`task`'s result, unless the client disconnects first: then `task` is cancelled (which
    aborts the engine requests it runs, freeing their blocks) and APIError 499 is raised."""
    left = asyncio.ensure_future(client_left(raw))
    either: set[asyncio.Future[Any]] = {task, left}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, message, err_type="client_closed_request")
    return task.result()
