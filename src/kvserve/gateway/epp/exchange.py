"""One HTTP request's ext_proc stream, as a state machine: headers and body in, a routing
answer out; then the response's headers and body, which feed the same bookkeeping as kvserve's
proxy (the worker's in-flight count, the policy's index, admission's first byte), until the
response ends or the stream closes (the client left).

Contract: a request is prepared by `prepare_request` (salted, keyed, its client's tenant and
salt headers dropped) exactly as the proxy does; it holds its admission slot from admission
until `close()`, the one place that releases it, whichever way the request ends; bad input is
an ImmediateResponse with an OpenAI-style error (400/401/404/405/413), a saturated fleet 429
with Retry-After, no eligible endpoint 503."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.client_timeout import BadTimeout, client_timeout_s, refusals_spend_retries
from kvserve.gateway.core.lifecycle import Dispatch
from kvserve.gateway.core.pipeline import NoHealthyWorker
from kvserve.gateway.core.prepare import Refused, prepare_request
from kvserve.gateway.core.seniority import Seniority
from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.epp import protocol
from kvserve.gateway.epp.endpoints import Endpoints
from kvserve.gateway.fleet.admission import Saturated
from kvserve.gateway.fleet.build import Fleet, note_arrival
from kvserve.wire.http import (
    ADMIN_KEY_HEADER,
    MODELS_PATH,
    PREFILL_URL_HEADER,
    PROXIED_PATHS,
    SALT_KEY_HEADER,
    TENANT_HEADER,
)


@dataclass(slots=True)
class Picker:
    """What every stream of one `kvserve epp` shares."""

    fleet: Fleet
    endpoints: Endpoints
    tenancy: Tenancy
    max_body_bytes: int
    ttft_target_s: float | None = None
    seniority: Seniority | None = field(default_factory=Seniority)
    worker_api_key: str | None = None
    trusted_salt_key: str | None = None

    def client_headers(self) -> set[str]:
        """Headers a client may send that only the gateway may set for a worker."""
        return {self.tenancy.header, TENANT_HEADER, SALT_KEY_HEADER, "authorization",
                ADMIN_KEY_HEADER.lower(), PREFILL_URL_HEADER.lower(),
                protocol.SUBSET_KEY}


class Exchange:
    """The state of one ext_proc stream; `handle` each message in order, `close` at the end."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.started = time.monotonic()
        self.mode = protocol.BUFFERED
        self.headers: dict[str, str] = {}
        self.path = ""
        self.body: list[bytes] = []
        self.size = 0
        self.subset: list[str] | None = None
        self.decided = False
        self.timeout_s: float | None = None
        self.dispatch: Dispatch | None = None  # from admission: the request's bookkeeping
        self.key = b""
        self.ended = False
        self.closed = False

    async def handle(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message from Envoy (none while a streamed body is still
        arriving)."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(request)
        if kind == "request_body":
            chunk = request.request_body
            if self.decided:  # past an answer: Envoy keeps streaming, nothing to add
                return []
            self.body.append(chunk.body)
            self.size += len(chunk.body)
            if self.size > self.picker.max_body_bytes:
                self.decided = True
                return [protocol.immediate(413, f"request body exceeds "
                                           f"{self.picker.max_body_bytes} bytes",
                                           "invalid_request_error")]
            return await self._decide() if chunk.end_of_stream else []
        if kind == "request_trailers":
            answers = [] if self.decided else await self._decide()
            return [*answers, protocol.continue_request_trailers()]
        if kind == "response_headers":
            return [self._response_headers(request)]
        if kind == "response_body":
            self._first_byte()
            if request.response_body.end_of_stream:
                self.ended = True
                self.close()
            return [protocol.continue_response_body()]
        if kind == "response_trailers":
            self.ended = True
            self.close()
            return [protocol.continue_response_trailers()]
        return []

    def _request_headers(self, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if request.HasField("protocol_config"):
            self.mode = request.protocol_config.request_body_mode
        self.headers = protocol.header_map(request.request_headers)
        self.path = self.headers.get(":path", "").split("?", 1)[0]
        method = self.headers.get(":method", "")
        self.subset = protocol.subset_hint(request)
        if self.path == MODELS_PATH and method == "GET":
            self.decided = True
            urls = self._eligible()
            if not urls:
                return [self._no_endpoint()]
            return [protocol.routed_without_body(
                [self.picker.endpoints.endpoint_of(u) for u in urls])]
        if self.path not in PROXIED_PATHS:
            self.decided = True
            return [protocol.immediate(404, f"{self.path or '/'} is not served here: the "
                                       f"fleet answers POST {', '.join(sorted(PROXIED_PATHS))}"
                                       f" and GET {MODELS_PATH}", "invalid_request_error")]
        if method != "POST":
            self.decided = True
            return [protocol.immediate(405, f"{self.path} takes POST", "invalid_request_error")]
        if request.request_headers.end_of_stream:
            self.decided = True
            return [protocol.immediate(400, "the request has no body: send a JSON object",
                                       "invalid_request_error")]
        # BUFFERED: Envoy waits for this answer before it sends the body; the routing answer
        # rides on the body's. FULL_DUPLEX_STREAMED: the body follows at once; both answers
        # wait for it.
        return [] if self.mode == protocol.FULL_DUPLEX_STREAMED \
            else [protocol.continue_request_headers()]

    def _eligible(self) -> list[str]:
        """Healthy workers (in pool order) the subset hint allows."""
        fleet = self.picker.fleet
        now = time.monotonic()
        allowed = None if self.subset is None else self.picker.endpoints.urls(self.subset)
        return [w.url for w in fleet.pool.serving(now)
                if allowed is None or w.url in allowed]

    def _no_endpoint(self) -> pb.ProcessingResponse:
        self.picker.fleet.metrics.rejections.labels("no_healthy_worker").inc()
        where = "" if self.subset is None else f" among the subset hint {self.subset}"
        return protocol.immediate(503, f"no healthy worker{where}: every worker failed its "
                                  "health check or is ejected; retry later",
                                  "service_unavailable", "1")

    async def _decide(self) -> list[pb.ProcessingResponse]:
        """Prepare, admit, route: the routing answer or an ImmediateResponse."""
        self.decided = True
        picker, fleet = self.picker, self.picker.fleet
        raw = b"".join(self.body)
        self.body = []
        try:
            prepared = prepare_request(self.path, raw, self.headers, picker.tenancy,
                                       fleet.keys.keyer, picker.worker_api_key,
                                       picker.trusted_salt_key, fleet.adapters)
            self.timeout_s = client_timeout_s(self.headers)
        except Refused as exc:
            return [protocol.immediate(exc.status, exc.message, exc.err_type)]
        except BadTimeout as exc:
            return [protocol.immediate(400, str(exc), "invalid_request_error")]
        self.key, since = note_arrival(prepared, self.path, raw, self.started, fleet.capacity,
                                       fleet.keys.keyer is None, picker.seniority,
                                       fleet.metrics)
        deadline = None if self.timeout_s is None else self.started + self.timeout_s
        try:
            # An SDK client counts a 429 as one of its few retries: it waits its turn.
            slot = await fleet.admission.admit(
                deadline, since, refuse_on_arrival=not refusals_spend_retries(self.headers))
        except Saturated as exc:
            fleet.metrics.rejections.labels(exc.reason).inc()
            return [protocol.immediate(429, f"the fleet is saturated ({exc.reason}); retry "
                                       f"after {exc.retry_after_s}s", "rate_limit_error",
                                       str(exc.retry_after_s))]
        dispatch = self.dispatch = fleet.dispatch(prepared.route, self.started,
                                                  time.monotonic(), deadline, slot)
        eligible = set(self._eligible())
        now = time.monotonic()
        views = [v for v in fleet.pool.views(now) if v.worker_id in eligible]
        try:
            if not views:
                raise NoHealthyWorker(len(fleet.pool.workers))
            decision = dispatch.pick(views)
        except NoHealthyWorker:
            dispatch.answered = True  # the EPP answers: nothing to tell the latency limit
            self.close()
            return [self._no_endpoint()]
        # Counted on its pick now, as the proxy counts it when it sends: a burst of one
        # prefix arriving meanwhile must see where it went.
        dispatch.send(decision.worker_id, time.monotonic())
        ranked = [u for u in dispatch.candidates() if u in eligible]
        payload = protocol.json_body(prepared.body)
        return protocol.routed(self.mode, [picker.endpoints.endpoint_of(u) for u in ranked],
                               payload, prepared.headers,
                               picker.client_headers() - set(prepared.headers))

    def _response_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        headers = protocol.header_map(request.response_headers)
        fleet, dispatch = self.picker.fleet, self.dispatch
        served = protocol.served_endpoint(request, headers)
        url = self.picker.endpoints.url_of(served) if served else None
        if (url is not None and url in fleet.pool.workers and dispatch is not None
                and dispatch.worker_id is not None):
            if url != dispatch.worker_id:
                # Envoy walked the fallback list: the request is the served worker's now.
                dispatch.failed()
                dispatch.send(url, time.monotonic(), "envoy")
            status = int(headers.get(":status", "0") or 0)
            backpressure = dispatch.answered_by(status)
            if not backpressure and 200 <= status < 300 and self.picker.seniority is not None:
                self.picker.seniority.served(self.key)
        if request.response_headers.end_of_stream:
            self._first_byte()
            self.ended = True
            self.close()
        return protocol.continue_response_headers(remove=[protocol.SERVED_KEY])

    def _first_byte(self) -> None:
        if self.dispatch is not None:
            self.dispatch.first_byte(time.monotonic())

    def close(self) -> None:
        """The end, however it came (response done, client gone, Envoy's stream closed): the
        one place the slot is released and the worker's in-flight count returned.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.dispatch is not None:
            # Not ended: the client left (or Envoy closed the stream) before the answer's end.
            self.dispatch.close(time.monotonic(), finished=self.ended,
                                client_left=not self.ended)
