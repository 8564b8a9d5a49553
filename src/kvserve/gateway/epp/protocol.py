"""The Endpoint Picker protocol in ext_proc v3 messages, pure (no gRPC, no sockets): what Envoy
tells the picker (headers, body mode, subset hint, the endpoint that served) and what the picker
answers (the chosen endpoints in a header and in `envoy.lb` dynamic metadata, the body a worker
gets, or an ImmediateResponse).

The names are the Gateway API Inference Extension's (docs/proposals/004-endpoint-picker-protocol
in kubernetes-sigs/gateway-api-inference-extension)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from kvserve.wire.http import error_body

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Envoy's http1 codec caps a body chunk near 64 KiB; streamed replacements stay under it.
MAX_CHUNK_BYTES = 62_000

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX_STREAMED = BodyMode.FULL_DUPLEX_STREAMED
BUFFERED = BodyMode.BUFFERED


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-case name -> value (the first of repeated names), pseudo-headers included; Envoy
    sends values as `raw_value` bytes."""
    found: dict[str, str] = {}
    for header in headers.headers.headers:
        value = header.raw_value.decode("latin-1") if header.raw_value else header.value
        found.setdefault(header.key.lower(), value)
    return found


def filter_metadata(request: pb.ProcessingRequest) -> dict[str, Any]:
    """The request's metadata_context as plain values, by namespace."""
    return {namespace: json_format.MessageToDict(value)
            for namespace, value in request.metadata_context.filter_metadata.items()}


def _endpoint_list(value: object) -> list[str]:
    """`ip:port` entries from a list or a comma-separated string (gateways send either)."""
    items = value if isinstance(value, list) else [value]
    return [part.strip() for item in items if isinstance(item, str)
            for part in item.split(",") if part.strip()]


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane restricts this request to; None when it sets no hint (an
    empty list is a hint that nothing is eligible)."""
    namespace = filter_metadata(request).get(SUBSET_NAMESPACE)
    if not isinstance(namespace, dict) or SUBSET_KEY not in namespace:
        return None
    return _endpoint_list(namespace[SUBSET_KEY])


def served_endpoint(request: pb.ProcessingRequest, headers: Mapping[str, str]) -> str | None:
    """The endpoint that produced the response: `envoy.lb` metadata, else the response header
    (which `envoy_config` has Envoy add); None when no upstream answered (a local reply)."""
    namespace = filter_metadata(request).get(DESTINATION_NAMESPACE)
    found = namespace.get(SERVED_KEY) if isinstance(namespace, dict) else None
    if not isinstance(found, str):
        found = headers.get(SERVED_KEY)
    endpoints = _endpoint_list(found) if found else []
    return endpoints[0] if endpoints and endpoints[0] != "-" else None


def _mutation(set_headers: Mapping[str, str], remove: Iterable[str]) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for name, value in set_headers.items()],
        remove_headers=sorted(set(remove) - set(set_headers)))


def destination_metadata(endpoints: list[str]) -> struct_pb2.Struct:
    """`envoy.lb` / `x-gateway-destination-endpoint`: the same list as the header."""
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: ",".join(endpoints)}})
    return metadata


def routed(mode: int, endpoints: list[str], body: bytes, set_headers: Mapping[str, str],
           remove: Iterable[str]) -> list[pb.ProcessingResponse]:
    """The answer that sends the request to `endpoints` (the pick first, then the fallbacks in
    order), with `body` replacing the client's and the header changes. In FULL_DUPLEX_STREAMED
    mode the headers' answer, then the body as streamed chunks; in BUFFERED mode one body
    answer carrying the header changes too (Envoy has not sent the headers on yet)."""
    headers = {**set_headers, DESTINATION_HEADER: ",".join(endpoints),
               "content-length": str(len(body))}
    metadata = destination_metadata(endpoints)
    mutation = _mutation(headers, remove)
    if mode == FULL_DUPLEX_STREAMED:
        answers = [pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=mutation)), dynamic_metadata=metadata)]
        chunks = [body[i:i + MAX_CHUNK_BYTES] for i in range(0, len(body), MAX_CHUNK_BYTES)]
        for index, chunk in enumerate(chunks or [b""]):
            last = index == max(len(chunks), 1) - 1
            answers.append(pb.ProcessingResponse(request_body=pb.BodyResponse(
                response=pb.CommonResponse(body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk,
                                                              end_of_stream=last))))))
        return answers
    return [pb.ProcessingResponse(
        # CONTINUE, not CONTINUE_AND_REPLACE: that would end the stream's later messages, and
        # the response path must still come.
        request_body=pb.BodyResponse(response=pb.CommonResponse(
            status=pb.CommonResponse.CONTINUE, header_mutation=mutation,
            body_mutation=pb.BodyMutation(body=body))),
        dynamic_metadata=metadata)]


def routed_without_body(endpoints: list[str]) -> pb.ProcessingResponse:
    """The headers' answer for a request without a body (GET /v1/models)."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=_mutation({DESTINATION_HEADER: ",".join(endpoints)}, ()))),
        dynamic_metadata=destination_metadata(endpoints))


def immediate(status: int, message: str, err_type: str,
              retry_after: str | None = None) -> pb.ProcessingResponse:
    """Envoy answers the client itself with an OpenAI-style error (no worker sees it)."""
    headers = {"content-type": "application/json"}
    if retry_after is not None:
        headers["retry-after"] = retry_after
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=_mutation(headers, ()), body=error_body(status, message, err_type),
        details=f"kvserve_epp_{status}"))


def continue_request_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def continue_request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def continue_response_headers(remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=_mutation({}, remove))))


def continue_response_body() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def continue_response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def json_body(body: Mapping[str, Any]) -> bytes:
    """The body a worker gets: compact JSON, as the proxy sends it."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
