"""The subscriber's /metrics series over real ZMQ sockets: the exact counts after a gap, a
replay, a restart and a partial replay, for a worker followed by the source every discovered
worker shares; and a worker that publishes nothing is named once in the log and unknown."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from kvserve.gateway.core.pipeline import PrecisePolicy
from kvserve.gateway.fleet.build import build_fleet
from kvserve.gateway.fleet.kv_event_metrics import KvEventCollector
from kvserve.gateway.fleet.kv_event_source import EventSource
from kvserve.gateway.fleet.settings import GatewaySettings
from kvserve.gateway.fleet.zmq_events import ZmqEventFollower
from kvserve.kvevents.wire import AllCleared, RemovedBlocks
from tests.gateway.test_zmq_events import URL, block, held, model, until
from tests.gateway.zmq_publisher import ScriptedPublisher
from tests.server.harness import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(registry: CollectorRegistry) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def grown(before: Samples, after: Samples) -> dict[str, float]:
    """What changed, as `name{label=value,...}` -> by how much (the worker label left out)."""
    out = {}
    for key, value in after.items():
        if value != before.get(key, 0.0):
            name, labels = key
            shown = ",".join(f"{k}={v}" for k, v in labels if k != "worker")
            out[f"{name}{{{shown}}}"] = value - before.get(key, 0.0)
    return out


def test_the_counters_follow_a_gap_a_restart_and_a_partial_replay_exactly() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port, replay_port = free_port(), free_port()
        pub = ScriptedPublisher(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        policy = PrecisePolicy(max_pending_blocks_per_worker=0)
        # No per-worker source: the one every worker binds (a Deployment's shared config).
        every = EventSource(f"tcp://*:{port}", f"tcp://*:{replay_port}", "kv")
        follower = ZmqEventFollower({}, policy, model, replay_timeout_s=1.0, default=every)
        registry = CollectorRegistry()
        registry.register(KvEventCollector(follower))
        try:
            follower.start([])
            follower.follow(URL)  # discovered after the start
            await until(lambda: policy.is_synced(URL))
            assert registry.get_sample_value("kvserve:gateway_kv_event_resyncs_total",
                                             {"worker": URL, "reason": "join"}) == 1
            probe = 0
            while follower.num_batches == 0:  # until the SUB socket has joined
                await pub.batch([RemovedBlocks((1000 + probe,), None)])
                probe += 1
                await asyncio.sleep(0.05)
            assert registry.get_sample_value("kvserve:gateway_kv_index_synced",
                                             {"worker": URL}) == 1

            before = samples(registry)
            await pub.batch([block(1)])
            await pub.batch([block(2)], live=False)  # lost on the way: replayed
            await pub.batch([block(3)])
            await until(lambda: held(policy, 3))
            assert grown(before, samples(registry)) == {
                "kvserve:gateway_kv_events_total{type=stored}": 3,
                "kvserve:gateway_kv_event_gaps_total{}": 1,
                "kvserve:gateway_kv_event_replays_total{outcome=complete}": 1,
                "kvserve:gateway_kv_event_resyncs_total{reason=gap}": 1}

            before = samples(registry)
            pub.restart()
            await pub.batch([block(4)], live=False)  # the new process's seq 0, never live
            await pub.batch([block(5)])
            await until(lambda: held(policy, 5))
            await pub.batch([AllCleared()])
            await until(lambda: not held(policy, 5))
            assert grown(before, samples(registry)) == {
                "kvserve:gateway_kv_events_total{type=stored}": 2,
                "kvserve:gateway_kv_events_total{type=cleared}": 1,
                "kvserve:gateway_kv_event_replays_total{outcome=complete}": 1,
                "kvserve:gateway_kv_event_resyncs_total{reason=restart}": 1}

            before = samples(registry)
            lost = await pub.batch([block(6)], live=False)
            await pub.batch([block(1)], live=False)
            pub.buffer = [(seq, payload) for seq, payload in pub.buffer if seq != lost]
            await pub.batch([block(2)])  # the replay lacks `lost`: rolled out of its buffer
            await until(lambda: held(policy, 2))
            assert grown(before, samples(registry)) == {
                "kvserve:gateway_kv_events_total{type=stored}": 2,
                "kvserve:gateway_kv_event_gaps_total{}": 1,
                "kvserve:gateway_kv_event_replays_total{outcome=partial}": 1,
                "kvserve:gateway_kv_event_resyncs_total{reason=gap}": 1}
            assert registry.get_sample_value("kvserve:gateway_kv_index_synced",
                                             {"worker": URL}) == 1

            follower.unfollow(URL)  # the worker left the fleet: its series go
            assert not [k for k in samples(registry) if ("worker", URL) in k[1]]
        finally:
            await follower.stop()
            await pub.close()
            ctx.destroy(0)

    asyncio.run(main())


def test_a_worker_that_publishes_nothing_is_named_once_and_its_index_unknown(
        caplog: pytest.LogCaptureFixture) -> None:
    silent = "http://10.0.0.7:8000"

    async def main() -> None:
        follower = ZmqEventFollower({}, PrecisePolicy(), model)
        registry = CollectorRegistry()
        registry.register(KvEventCollector(follower))
        follower.start([silent])
        follower.unfollow(silent)  # it leaves and comes back (discovery): still said once
        follower.follow(silent)
        assert registry.get_sample_value("kvserve:gateway_kv_index_synced",
                                         {"worker": silent}) == 0
        await follower.stop()

    with caplog.at_level(logging.WARNING, logger="kvserve.gateway.fleet.zmq_events"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if silent in r.getMessage()]
    assert len(said) == 1
    assert f"--worker-kv-events {silent}=tcp://*:5557" in said[0]
    assert "--kv-events-config" in said[0]


def test_every_front_end_exports_the_series_from_the_fleet_it_builds() -> None:
    """The proxy and `kvserve epp` both build their routing state with `build_fleet`."""
    url = "http://127.0.0.1:9"
    every = EventSource("tcp://*:5557", "tcp://*:5558")
    fleet = build_fleet(GatewaySettings(workers=(url,), policy="precise",
                                        kv_events_default=every))
    assert fleet.subscriber is not None and fleet.subscriber.default == every
    text = generate_latest(fleet.metrics.registry).decode()
    for family in ("kv_events_total counter", "kv_event_gaps_total counter",
                   "kv_event_replays_total counter", "kv_event_resyncs_total counter",
                   "kv_index_synced gauge"):
        assert f"# TYPE kvserve:gateway_{family}\n" in text
    asyncio.run(fleet.subscriber.stop())
    with pytest.raises(ValueError, match="feeds --policy precise's index"):
        build_fleet(GatewaySettings(workers=(url,), policy="cache_aware",
                                    kv_events_default=every))


def test_a_replay_endpoint_that_does_not_answer_counts_a_timeout() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port = free_port()
        pub = ScriptedPublisher(ctx, f"tcp://127.0.0.1:{port}", None)
        policy = PrecisePolicy(max_pending_blocks_per_worker=0)
        nobody = f"tcp://*:{free_port()}"  # a replay endpoint no publisher bound
        follower = ZmqEventFollower({URL: EventSource(f"tcp://*:{port}", nobody, "kv")}, policy,
                                    model, replay_timeout_s=0.2)
        registry = CollectorRegistry()
        registry.register(KvEventCollector(follower))
        try:
            follower.start()
            await until(lambda: policy.is_synced(URL))  # synced anyway, partial
            assert registry.get_sample_value("kvserve:gateway_kv_event_replays_total",
                                             {"worker": URL, "outcome": "timeout"}) == 1
            assert URL in follower.partial
        finally:
            await follower.stop()
            await pub.close()
            ctx.destroy(0)

    asyncio.run(main())
