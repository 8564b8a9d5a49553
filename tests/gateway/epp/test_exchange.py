"""The Endpoint Picker's protocol translation, with no sockets: ext_proc messages in, the
answers Envoy would get out, over a real routing core (pool, policy, admission) whose workers
are never contacted."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.epp import protocol
from kvserve.gateway.epp.endpoints import Endpoints
from kvserve.gateway.epp.exchange import Exchange, Picker
from kvserve.gateway.fleet.build import Fleet, build_fleet
from kvserve.gateway.fleet.settings import GatewaySettings
from kvserve.wire.http import SALT_KEY_HEADER

WORKERS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
SECRET = "exchange-test-secret-0123456789"
SALT_KEY = "exchange-test-salt-key"
FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def make_picker(**settings: object) -> Picker:
    tenancy = Tenancy.from_options(SECRET, trust_header=True)
    fleet = build_fleet(GatewaySettings(workers=WORKERS, policy="prefix_hash",
                                        tenancy=tenancy, latency_limit=False,
                                        trusted_salt_key=SALT_KEY, **settings))  # type: ignore[arg-type]
    return Picker(fleet, Endpoints.from_urls(list(WORKERS)), tenancy, 1 << 20,
                  trusted_salt_key=SALT_KEY)


def headers_message(path: str = "/v1/completions", method: str = "POST",
                    headers: dict[str, str] | None = None, mode: int = FULL,
                    end_of_stream: bool = False,
                    metadata: dict[str, object] | None = None) -> pb.ProcessingRequest:
    values = {":path": path, ":method": method, "content-type": "application/json",
              **(headers or {})}
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in values.items()]),
        end_of_stream=end_of_stream))
    request.protocol_config.request_body_mode = mode
    for namespace, value in (metadata or {}).items():
        struct = struct_pb2.Struct()
        struct.update(value)  # type: ignore[arg-type]
        request.metadata_context.filter_metadata[namespace].CopyFrom(struct)
    return request


def body_messages(body: dict[str, object], chunks: int = 3) -> list[pb.ProcessingRequest]:
    raw = json.dumps(body).encode()
    size = -(-len(raw) // chunks)
    parts = [raw[i:i + size] for i in range(0, len(raw), size)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=part,
                                                          end_of_stream=i == len(parts) - 1))
            for i, part in enumerate(parts)]


def response_headers(status: int, served: str | None,
                     end_of_stream: bool = False) -> pb.ProcessingRequest:
    values = {":status": str(status)}
    if served is not None:
        values[protocol.SERVED_KEY] = served
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in values.items()]),
        end_of_stream=end_of_stream))


def run(exchange: Exchange, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async def go() -> list[pb.ProcessingResponse]:
        answers: list[pb.ProcessingResponse] = []
        for message in messages:
            answers += await exchange.handle(message)
        return answers
    return asyncio.run(go())


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def routed_parts(answers: list[pb.ProcessingResponse]) -> tuple[dict[str, str], list[str],
                                                                 bytes, list[str]]:
    """(headers set, headers removed, the body sent on, metadata destinations) of a FULL_DUPLEX
    routing answer."""
    assert answers[0].WhichOneof("response") == "request_headers"
    mutation = answers[0].request_headers.response.header_mutation
    body = b"".join(a.request_body.response.body_mutation.streamed_response.body
                    for a in answers[1:])
    assert answers[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    metadata = json_format.MessageToDict(answers[0].dynamic_metadata)
    return (set_headers(mutation), list(mutation.remove_headers), body,
            metadata[protocol.DESTINATION_NAMESPACE][protocol.DESTINATION_HEADER].split(","))


def fleet_in_flight(fleet: Fleet) -> dict[str, int]:
    return {url: w.in_flight for url, w in fleet.pool.workers.items()}


def test_full_duplex_routes_with_the_tenant_salt_and_a_fallback_list() -> None:
    picker = make_picker()
    exchange = Exchange(picker)
    tenant_salt = picker.tenancy.salt_for("alice")
    answers = run(exchange, [
        headers_message(headers={"x-tenant-id": "alice", SALT_KEY_HEADER: "forged",
                                 "x-request-id": "r1"}),
        *body_messages({"model": "m", "prompt": "hello " * 40, "cache_salt": "forged-salt"})])
    headers, removed, body, listed = routed_parts(answers)
    sent = json.loads(body)
    assert sent["cache_salt"] == tenant_salt != "forged-salt"
    assert headers["content-length"] == str(len(body))
    assert headers[SALT_KEY_HEADER] == SALT_KEY  # the EPP's, never the client's
    assert headers["x-tenant-id"] == "alice" and headers["x-request-id"] == "r1"
    # Every healthy worker, the pick first; the header and the metadata say the same.
    assert headers[protocol.DESTINATION_HEADER] == ",".join(listed)
    assert sorted(listed) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert "authorization" in removed and protocol.SUBSET_KEY in removed
    picked = picker.endpoints.by_endpoint[listed[0]]
    assert fleet_in_flight(picker.fleet)[picked] == 1
    assert picker.fleet.admission.in_flight == 1
    # The answer streams back and ends: the slot and the in-flight count are returned.
    run(exchange, [response_headers(200, listed[0]),
                   pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x",
                                                                  end_of_stream=True))])
    assert picker.fleet.admission.in_flight == 0
    assert set(fleet_in_flight(picker.fleet).values()) == {0}
    assert picker.fleet.pool.get(picked).abandoned == 0
    exchange.close()  # Envoy's stream closing afterwards changes nothing
    assert picker.fleet.admission.in_flight == 0 and picker.fleet.pool.get(picked).in_flight == 0


def test_one_tenant_one_worker_and_tenants_apart() -> None:
    picker = make_picker()

    def pick(tenant: str, suffix: str) -> str:
        exchange = Exchange(picker)
        answers = run(exchange, [headers_message(headers={"x-tenant-id": tenant}),
                                 *body_messages({"prompt": "shared system prompt " * 20
                                                 + suffix})])
        exchange.close()
        return routed_parts(answers)[3][0]

    alice = {pick("alice", str(i)) for i in range(5)}
    assert len(alice) == 1
    assert picker.fleet.admission.in_flight == 0


def test_buffered_mode_answers_headers_then_routes_on_the_body() -> None:
    picker = make_picker()
    exchange = Exchange(picker)
    first = run(exchange, [headers_message("/v1/chat/completions", mode=BUFFERED,
                                           headers={"x-tenant-id": "bob"})])
    assert [a.WhichOneof("response") for a in first] == ["request_headers"]
    assert not first[0].request_headers.response.HasField("header_mutation")
    answers = run(exchange, body_messages({"messages": [{"role": "user", "content": "hi"}],
                                           "cache_salt": "mine"}, chunks=1))
    assert len(answers) == 1
    common = answers[0].request_body.response
    assert common.status == pb.CommonResponse.CONTINUE  # the response path still comes
    sent = json.loads(common.body_mutation.body)
    assert sent["cache_salt"] == picker.tenancy.salt_for("bob")
    headers = set_headers(common.header_mutation)
    assert headers["content-length"] == str(len(common.body_mutation.body))
    destinations = json_format.MessageToDict(answers[0].dynamic_metadata)
    assert destinations["envoy.lb"][protocol.DESTINATION_HEADER] == \
        headers[protocol.DESTINATION_HEADER]
    exchange.close()
    assert picker.fleet.admission.in_flight == 0


def test_envoy_failover_moves_the_request_to_the_served_worker() -> None:
    picker = make_picker()
    exchange = Exchange(picker)
    answers = run(exchange, [headers_message(), *body_messages({"prompt": "abc " * 30})])
    listed = routed_parts(answers)[3]
    first, fallback = (picker.endpoints.by_endpoint[e] for e in listed[:2])
    run(exchange, [response_headers(200, listed[1])])
    assert fleet_in_flight(picker.fleet)[first] == 0
    assert fleet_in_flight(picker.fleet)[fallback] == 1
    assert picker.fleet.metrics.retries.labels("envoy")._value.get() == 1
    run(exchange, [pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))])
    assert set(fleet_in_flight(picker.fleet).values()) == {0}
    assert picker.fleet.admission.in_flight == 0


def test_subset_hint_picks_only_among_it_and_an_empty_one_is_503() -> None:
    picker = make_picker()
    for hint in (["10.0.0.3:8000"], "10.0.0.2:8000,10.0.0.3:8000"):
        exchange = Exchange(picker)
        meta = {protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: hint}}
        answers = run(exchange, [headers_message(metadata=meta),
                                 *body_messages({"prompt": "xyz " * 30})])
        allowed = hint if isinstance(hint, list) else hint.split(",")
        assert sorted(routed_parts(answers)[3]) == sorted(allowed)
        exchange.close()
    exchange = Exchange(picker)
    meta = {protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: ["10.9.9.9:8000"]}}
    answers = run(exchange, [headers_message(metadata=meta),
                             *body_messages({"prompt": "xyz"})])
    assert answers[0].immediate_response.status.code == 503
    assert json.loads(answers[0].immediate_response.body)["error"]["type"] == \
        "service_unavailable"
    exchange.close()
    assert picker.fleet.admission.in_flight == 0


def test_saturated_is_429_with_retry_after_and_the_slot_comes_back() -> None:
    picker = make_picker(max_in_flight=1, max_queued=0)
    holder = Exchange(picker)
    run(holder, [headers_message(), *body_messages({"prompt": "first"})])
    refused = Exchange(picker)
    answers = run(refused, [headers_message(), *body_messages({"prompt": "second"})])
    immediate = answers[0].immediate_response
    assert immediate.status.code == 429
    assert {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}[
        "retry-after"] == b"1"
    assert json.loads(immediate.body)["error"]["type"] == "rate_limit_error"
    refused.close()
    assert picker.fleet.admission.in_flight == 1
    holder.close()  # the client left before its first byte
    assert picker.fleet.admission.in_flight == 0
    again = Exchange(picker)
    assert run(again, [headers_message(), *body_messages({"prompt": "third"})])[0] \
        .WhichOneof("response") == "request_headers"
    again.close()


@pytest.mark.parametrize(("message", "status"), [
    (headers_message(path="/debug/kv", method="GET", end_of_stream=True), 404),
    (headers_message(method="GET", end_of_stream=True), 405),
    (headers_message(end_of_stream=True), 400),
])
def test_wrong_routes_are_answered_by_the_picker(message: pb.ProcessingRequest,
                                                 status: int) -> None:
    answers = run(Exchange(make_picker()), [message])
    assert answers[0].immediate_response.status.code == status
    assert json.loads(answers[0].immediate_response.body)["error"]["code"] == status


def test_bad_json_is_400_and_reaches_no_worker() -> None:
    picker = make_picker()
    exchange = Exchange(picker)
    answers = run(exchange, [headers_message(), pb.ProcessingRequest(
        request_body=pb.HttpBody(body=b"{not json", end_of_stream=True))])
    assert answers[0].immediate_response.status.code == 400
    exchange.close()
    assert picker.fleet.admission.in_flight == 0 and set(
        fleet_in_flight(picker.fleet).values()) == {0}


def test_endpoints_refuse_what_envoy_cannot_route_to() -> None:
    for url, says in (("https://10.0.0.1:8000", "not http://HOST:PORT"),
                      ("http://10.0.0.1", "gives no port"),
                      ("http://10.0.0.1:8000/v1", "not http://HOST:PORT")):
        with pytest.raises(ValueError, match=says):
            Endpoints.from_urls([url])
    named = Endpoints.from_urls(["http://worker-a:8000"], resolve=lambda host, port: "10.1.2.3")
    assert named.by_url == {"http://worker-a:8000": "10.1.2.3:8000"}
    assert named.resolved == {"worker-a": "10.1.2.3"}
    with pytest.raises(ValueError, match="already names"):
        Endpoints.from_urls(["http://10.0.0.1:8000", "http://10.0.0.1:8000/"])


def test_a_discovered_worker_is_named_by_its_address_both_ways() -> None:
    endpoints = Endpoints.from_urls([], resolve=lambda host, port: "10.4.5.6")
    assert endpoints.endpoint_of("http://10.0.0.9:8000") == "10.0.0.9:8000"
    assert endpoints.url_of("10.0.0.9:8000") == "http://10.0.0.9:8000"
    assert endpoints.url_of("10.0.0.7:8000") == "http://10.0.0.7:8000"  # not seen yet
    assert endpoints.endpoint_of("http://worker-b:8000") == "10.4.5.6:8000"
    assert endpoints.url_of("10.4.5.6:8000") == "http://worker-b:8000"
