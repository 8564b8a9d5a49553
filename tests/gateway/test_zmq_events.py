"""The ZMQ subscriber over real sockets: late join, gap -> replay, restarts, malformed frames,
bind/connect, data-parallel ranks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq.asyncio

from kvserve.gateway.core.pipeline import PrecisePolicy, RouteRequest
from kvserve.gateway.core.prefix import engine_block_hashes
from kvserve.gateway.fleet.kv_event_source import EventSource
from kvserve.gateway.fleet.zmq_events import ZmqEventFollower
from kvserve.kvevents.wire import AllCleared, RemovedBlocks, StoredBlocks
from tests.gateway.helpers import views
from tests.gateway.zmq_publisher import ScriptedPublisher
from tests.server.harness import free_port

BS = 4
URL = "http://127.0.0.1:9"
TOKENS = [list(range(10 * i, 10 * i + BS)) for i in range(1, 8)]  # one block each


def block(n: int) -> StoredBlocks:
    """Root block n (publisher hash n): its own prompt TOKENS[n]."""
    return StoredBlocks((n,), None, tuple(TOKENS[n]), BS)


def held(policy: PrecisePolicy, n: int) -> bool:
    key = engine_block_hashes(TOKENS[n], BS, None, "tiny")
    decision = policy.route(RouteRequest(key, None, BS), views({URL: 0, "other": 0}))
    return decision.worker_id == URL and decision.predicted_hit_blocks == 1


async def model(_: str) -> str:
    return "tiny"


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


Scenario = Callable[[ScriptedPublisher, ZmqEventFollower, PrecisePolicy], Awaitable[None]]


def run(scenario: Scenario, replay: bool = True, worker_binds: bool = True) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port, replay_port = free_port(), free_port()
        # As the worker was configured: tcp://*:P (it binds) or tcp://127.0.0.1:P (it connects)
        worker_endpoint = f"tcp://*:{port}" if worker_binds else f"tcp://127.0.0.1:{port}"
        publisher = ScriptedPublisher(ctx, f"tcp://127.0.0.1:{port}",
                                      f"tcp://127.0.0.1:{replay_port}" if replay else None,
                                      bind=worker_binds)
        policy = PrecisePolicy(max_pending_blocks_per_worker=0)
        source = EventSource(worker_endpoint, f"tcp://*:{replay_port}" if replay else None, "kv")
        follower = ZmqEventFollower({URL: source}, policy, model, replay_timeout_s=1.0)
        try:
            await scenario(publisher, follower, policy)
        finally:
            await follower.stop()
            await publisher.close()
            ctx.destroy(0)

    asyncio.run(main())


async def start(follower: ZmqEventFollower, publisher: ScriptedPublisher,
                policy: PrecisePolicy) -> None:
    """Start following and wait until live batches arrive (a SUB joins a moment late)."""
    follower.start()
    await until(lambda: policy.is_synced(URL))
    probe = 0
    while follower.num_batches == 0 or URL not in follower.feeds:
        await publisher.batch([RemovedBlocks((1000 + probe,), None)])
        probe += 1
        await asyncio.sleep(0.05)
        assert probe < 100


def test_a_late_joiner_replays_from_seq_0_and_is_unknown_until_then() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await pub.batch([block(1)], live=False)  # published before the gateway came
        await pub.batch([block(2), RemovedBlocks((1,), "GPU")], live=False)
        follower.start()
        assert not policy.is_synced(URL)
        await until(lambda: policy.is_synced(URL))
        assert pub.replays == [0] and not held(policy, 1) and held(policy, 2)
        assert URL not in follower.partial
    run(scenario)


def test_a_gap_is_filled_from_the_replay_endpoint() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.batch([block(1)])
        await pub.batch([block(2)], live=False)  # lost on the way
        await pub.batch([block(3)])
        await until(lambda: held(policy, 3))
        assert held(policy, 1) and held(policy, 2)
        assert follower.num_gaps == 1 and pub.replays[-1] == pub.seq - 2
        assert policy.is_synced(URL) and URL not in follower.partial
    run(scenario)


def test_a_restarted_worker_starts_again_from_an_empty_index() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.batch([block(1)])
        await until(lambda: held(policy, 1))
        pub.restart()
        await pub.batch([block(2)])  # seq 0 of the new process
        await until(lambda: held(policy, 2))
        assert not held(policy, 1) and follower.num_restarts == 1
        await pub.batch([block(5)])
        await pub.batch([block(6)])
        await until(lambda: held(policy, 6))
        pub.restart()
        await pub.batch([block(3)], live=False)  # the new process's seq 0 never came live
        await pub.batch([block(4)])
        await until(lambda: held(policy, 4))
        assert held(policy, 3) and not held(policy, 2) and pub.replays[-1] == 0
        assert follower.num_restarts == 2 and policy.is_synced(URL)
    run(scenario)


def test_all_blocks_cleared_and_removals_by_vllm_hash_arrive_over_the_socket() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.batch([block(1), block(2), block(3)])
        await until(lambda: held(policy, 2))
        await pub.batch([RemovedBlocks((2,), None)])
        await until(lambda: not held(policy, 2))
        assert held(policy, 1) and held(policy, 3)
        await pub.batch([AllCleared()])
        await until(lambda: not held(policy, 1))  # held a moment ago: the batch came
        assert not held(policy, 3)
    run(scenario)


def test_a_malformed_message_is_skipped_and_counted() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.raw([b"kv", (pub.seq).to_bytes(8, "big"), b"\xc1"])
        pub.seq += 1
        await until(lambda: follower.num_malformed == 1)
        await pub.batch([block(5)])  # a gap now (the malformed batch's seq): replayed past it
        await until(lambda: held(policy, 5))
    run(scenario)


def test_without_a_replay_endpoint_a_gap_leaves_a_partial_index() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.batch([block(1)], live=False)
        await pub.batch([block(2)])
        await until(lambda: held(policy, 2))
        assert not held(policy, 1) and URL in follower.partial and policy.is_synced(URL)
    run(scenario, replay=False)


def test_a_publisher_that_connects_finds_the_subscriber_bound() -> None:
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await start(follower, pub, policy)
        await pub.batch([block(1)])
        await until(lambda: held(policy, 1))
    run(scenario, worker_binds=False)


def test_each_data_parallel_rank_is_followed_on_its_port_offset() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port = free_port()
        while True:  # two consecutive free ports
            try:
                ranks = [ScriptedPublisher(ctx, f"tcp://127.0.0.1:{port + r}", None)
                         for r in range(2)]
                break
            except zmq.ZMQError:
                port = free_port()
        policy = PrecisePolicy(max_pending_blocks_per_worker=0)
        follower = ZmqEventFollower({URL: EventSource(f"tcp://*:{port}", None, "kv", 2)},
                                    policy, model)
        try:
            follower.start()
            for _ in range(100):
                await ranks[1].batch([block(2)], rank=1)
                await asyncio.sleep(0.05)
                if held(policy, 2):
                    break
            assert held(policy, 2) and not held(policy, 1)
            for _ in range(100):
                await ranks[0].batch([block(1)])
                await asyncio.sleep(0.05)
                if held(policy, 1):
                    break
            assert held(policy, 1)
        finally:
            await follower.stop()
            for publisher in ranks:
                await publisher.close()
            ctx.destroy(0)

    asyncio.run(main())


@pytest.mark.parametrize(("spec", "says"), [
    ("tcp://10.0.0.5:5557", "a source for every worker must be one each worker binds"),
    ("w:8000=tcp://*:5557", r"expected \[URL=\]ENDPOINT"),
    ("http://w:8000=udp://x:1", "expected tcp://HOST:PORT"),
    ("http://w:8000=tcp://*:5557,nope=1", "unknown option"),
    ("http://w:8000=tcp://*:5557,dp=0", "dp must be"),
])
def test_a_bad_worker_kv_events_flag_says_the_form(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        EventSource.parse(spec)


def test_the_flag_parses_every_option() -> None:
    assert EventSource.parse("http://w:8000/=tcp://*:5557,replay=tcp://*:5558,topic=kv,dp=2") == (
        "http://w:8000", EventSource("tcp://*:5557", "tcp://*:5558", "kv", 2))
    assert EventSource.parse("tcp://*:5557,replay=tcp://*:5558") == (  # every worker's
        None, EventSource("tcp://*:5557", "tcp://*:5558"))


@pytest.mark.parametrize("worker_binds", [True, False], ids=["worker-binds", "worker-connects"])
def test_once_synced_the_next_live_batch_arrives(worker_binds: bool) -> None:
    """Synced means subscribed: the first batch published after it is received, not dropped
    by a PUB that has not yet heard the subscription (ZMQ's slow joiner). It follows a
    publisher that connected before the subscriber bound, as `kvserve up` starts them."""
    async def scenario(pub: ScriptedPublisher, follower: ZmqEventFollower,
                       policy: PrecisePolicy) -> None:
        await asyncio.sleep(0.15)  # the publisher has already tried (and failed) to connect
        follower.start()
        await until(lambda: policy.is_synced(URL))
        await pub.batch([block(1)])  # no probe, no sleep: the one batch must come
        await until(lambda: held(policy, 1), 3.0)
    run(scenario, worker_binds=worker_binds)
