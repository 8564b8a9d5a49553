"""One request trace through the three users of the dispatch lifecycle: the proxy's forwarder
(over real loopback workers), the Endpoint Picker's exchange (ext_proc messages, no sockets) and
the simulator's gateway. Each routes with its own instance of the same policy; all three must
make the same picks from the same worker views and leave the same counts behind, step by step,
because all three drive `core.lifecycle.Dispatch` rather than a copy of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.gateway.core.pipeline import (
    CacheAwarePolicy,
    RouteDecision,
    RouteRequest,
    WorkerView,
)
from kvserve.gateway.core.prepare import prepare_request
from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.epp.endpoints import Endpoints
from kvserve.gateway.epp.exchange import Exchange, Picker
from kvserve.gateway.fleet.build import Fleet, build_fleet
from kvserve.gateway.fleet.settings import GatewaySettings
from kvserve.gateway.proxy.forward import Forwarder, Upstream
from kvserve.sim.gateway import SimGateway
from tests.gateway.epp.test_exchange import body_messages, headers_message, response_headers
from tests.gateway.loopback import loopback_workers

SECRET = "lifecycle-agreement-secret-0123"
PATH = "/v1/completions"
# (open or close, request index): requests overlap, so the picks see each other's counts.
TRACE = [("open", 0), ("open", 1), ("open", 2), ("close", 0), ("open", 3), ("open", 4),
         ("close", 2), ("close", 1), ("open", 5), ("close", 3), ("close", 4), ("close", 5)]
PROMPTS = [("acme", "acme's long shared system prompt " * 20 + "question one"),
           ("acme", "acme's long shared system prompt " * 20 + "question two"),
           ("zeta", "zeta's other shared system prompt " * 20 + "first"),
           ("acme", "acme's long shared system prompt " * 20 + "question three"),
           ("kilo", "kilo's prompt " * 30),
           ("zeta", "zeta's other shared system prompt " * 20 + "second")]

Step = tuple[object, ...]


class Recorder:
    """A real cache_aware policy that also writes down every call a dispatch makes of it."""

    def __init__(self, log: list[Step]) -> None:
        self.policy = CacheAwarePolicy()
        self.log = log
        self.name = self.policy.name
        self.replica_safe = self.policy.replica_safe

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        decision = self.policy.route(request, workers)
        seen = tuple(sorted((w.worker_id, w.in_flight, w.prefill_backlog_tokens)
                            for w in workers))
        self.log.append(("pick", request.num_tokens, seen, decision.worker_id,
                         decision.predicted_hit_blocks))
        return decision

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        self.log.append(("observe", worker_id))
        self.policy.observe(request, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self.policy.remove_worker(worker_id)


def tenancy() -> Tenancy:
    return Tenancy.from_options(SECRET, trust_header=True)


def raw_body(index: int) -> bytes:
    return json.dumps({"model": "m", "prompt": PROMPTS[index][1], "max_tokens": 1}).encode()


def headers_of(index: int) -> dict[str, str]:
    return {"x-tenant-id": PROMPTS[index][0], "content-type": "application/json"}


def route_of(index: int) -> RouteRequest:
    """The request keyed exactly as both gateway front ends key it."""
    return prepare_request(PATH, raw_body(index), headers_of(index), tenancy()).route


def fleet_over(urls: list[str]) -> Fleet:
    return build_fleet(GatewaySettings(workers=tuple(urls), policy="cache_aware",
                                       tenancy=tenancy(), latency_limit=False))


def counts(in_flight: dict[str, int], backlog: dict[str, int]) -> Step:
    return ("counts", tuple(sorted((w, in_flight[w], backlog[w]) for w in in_flight)))


def pool_counts(fleet: Fleet) -> Step:
    workers = fleet.pool.workers
    return counts({u: w.in_flight for u, w in workers.items()},
                  {u: w.prefill_backlog_tokens for u, w in workers.items()})


async def through_the_proxy(urls: list[str]) -> list[Step]:
    log: list[Step] = []
    fleet = fleet_over(urls)
    forwarder = Forwarder(fleet.pool, Recorder(log), fleet.upstream_client, fleet.budget,
                          fleet.metrics, "cache_aware", 30.0)
    open_: dict[int, Upstream] = {}
    try:
        for action, index in TRACE:
            if action == "open":
                dispatch = forwarder.dispatch(route_of(index), 0.0)
                open_[index] = await forwarder.open(PATH, json.loads(raw_body(index)), {},
                                                    dispatch)
                dispatch.first_byte(1.0)
            else:
                await open_.pop(index).read()
            log.append(pool_counts(fleet))
    finally:
        await fleet.upstream_client.aclose()
        await fleet.client.aclose()
    return log


def through_the_picker(urls: list[str]) -> list[Step]:
    log: list[Step] = []
    fleet = fleet_over(urls)
    fleet.policy = Recorder(log)  # type: ignore[assignment]
    endpoints = Endpoints.from_urls(urls)
    picker = Picker(fleet, endpoints, tenancy(), 1 << 20)
    exchanges: dict[int, Exchange] = {}

    async def go() -> None:
        for action, index in TRACE:
            if action == "open":
                exchange = exchanges[index] = Exchange(picker)
                for message in [headers_message(headers=headers_of(index)),
                                *body_messages(json.loads(raw_body(index)))]:
                    await exchange.handle(message)
                assert exchange.dispatch is not None and exchange.dispatch.worker_id
                served = endpoints.endpoint_of(exchange.dispatch.worker_id)
                await exchange.handle(response_headers(200, served))
                await exchange.handle(pb.ProcessingRequest(
                    response_body=pb.HttpBody(body=b"x", end_of_stream=False)))
            else:
                await exchanges.pop(index).handle(pb.ProcessingRequest(
                    response_body=pb.HttpBody(body=b"", end_of_stream=True)))
            log.append(pool_counts(fleet))
    asyncio.run(go())
    return log


def through_the_simulator(urls: list[str]) -> list[Step]:
    log: list[Step] = []
    gateway = SimGateway(Recorder(log), urls)  # type: ignore[arg-type]
    dispatches = {}
    for action, index in TRACE:
        if action == "open":
            dispatch = dispatches[index] = gateway.dispatch(route_of(index), 0.0, 0.0)
            dispatch.answered_by(200)  # the first token
            dispatch.first_byte(1.0)
        else:
            dispatches.pop(index).close(2.0, finished=True)
        log.append(counts(gateway.in_flight, gateway.backlog_tokens))
    return log


def test_proxy_picker_and_simulator_pick_and_count_alike() -> None:
    async def main() -> tuple[list[str], list[Step]]:
        async with loopback_workers(3, lambda url, path: (200, "{}")) as urls:
            return urls, await through_the_proxy(urls)

    urls, proxy = asyncio.run(main())
    picker = through_the_picker(urls)
    simulator = through_the_simulator(urls)
    picks = [step for step in proxy if step[0] == "pick"]
    assert len(picks) == 6 and len({step[3] for step in picks}) >= 2  # the trace spreads
    assert any(step[4] > 0 for step in picks)  # and some picks follow a cached prefix
    assert proxy == picker == simulator
    assert proxy[-1] == counts(dict.fromkeys(urls, 0), dict.fromkeys(urls, 0))
