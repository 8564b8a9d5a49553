"""vLLM 0.32's own KV events, recorded from its CPU build (tests/data/vllm_kv_events, made by
capture.py there): decoded, keyed by kvserve's chain, and followed over real sockets."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq.asyncio

from kvserve.gateway.core.pipeline import PrecisePolicy
from kvserve.gateway.core.prefix import engine_block_hashes
from kvserve.gateway.fleet.event_index import WorkerIndexFeed
from kvserve.gateway.fleet.kv_event_source import EventSource
from kvserve.gateway.fleet.zmq_events import ZmqEventFollower
from kvserve.kvevents.wire import (
    END_OF_REPLAY_SEQ,
    AllCleared,
    EventMessage,
    RemovedBlocks,
    StoredBlocks,
    decode_message,
    decode_seq,
)
from tests.gateway.zmq_publisher import ScriptedPublisher
from tests.server.harness import free_port

RECORDING = Path(__file__).parents[1] / "data" / "vllm_kv_events" / "vllm-0.32-cpu.jsonl"
URL = "http://127.0.0.1:9"


def load() -> tuple[dict[str, Any], list[tuple[str, list[bytes]]]]:
    lines = RECORDING.read_text().splitlines()
    run = json.loads(lines[0])["run"]
    messages = []
    for line in lines[1:]:
        item = json.loads(line)
        messages.append((item["via"], [base64.b64decode(f) for f in item["frames"]]))
    return run, messages


RUN, MESSAGES = load()
BS = RUN["block_size"]
MODEL = RUN["served_model_name"]
PROMPTS = [r["prompt"] for r in RUN["prompts"]]  # request i's prompt (request 1 is salted)
SALT = RUN["prompts"][1]["cache_salt"]


def history() -> list[EventMessage]:
    """Everything the publisher sent, from seq 0: the replay a late joiner got."""
    return [decode_message(frames) for via, frames in MESSAGES
            if via == "replay" and decode_seq(frames[1]) != END_OF_REPLAY_SEQ]


def keys(prompt: list[int], salt: str | None = None) -> tuple[bytes, ...]:
    return engine_block_hashes(prompt, BS, salt, MODEL)


def test_every_recorded_message_decodes_and_the_replay_ends_with_its_marker() -> None:
    live = [decode_message(f) for via, f in MESSAGES if via == "pub"]
    replay = [f for via, f in MESSAGES if via == "replay"]
    assert [m.seq for m in history()] == list(range(len(replay) - 1))
    assert decode_seq(replay[-1][1]) == END_OF_REPLAY_SEQ
    assert {m.topic for m in live} == {"kv"} and {m.data_parallel_rank for m in live} == {0}
    # vLLM 0.32 sends events as maps with a "type" key, hashes as uint64 integers
    first = msgpack.unpackb(replay[0][2])[1][0]
    assert first["type"] == "BlockStored" and isinstance(first["block_hashes"][0], int)
    # the live stream missed seq 0 (the publisher connected after its first batch): a real gap
    assert live[0].seq == 1
    kinds = {type(e) for m in history() for e in m.events}
    assert kinds == {StoredBlocks, RemovedBlocks, AllCleared}


def test_the_tagged_array_encoding_of_the_same_events_decodes_the_same() -> None:
    order = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                             "lora_id", "medium", "lora_name", "extra_keys"),
             "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
    for via, frames in MESSAGES:
        if via != "replay" or not frames[2]:
            continue
        ts, events, rank = msgpack.unpackb(frames[2])
        tagged = [[e["type"], *(e.get(f) for f in order[e["type"]])] for e in events]
        again = decode_message([frames[0], frames[1], msgpack.packb([ts, tagged, rank])])
        assert again == decode_message(frames)


def test_the_late_joiners_index_is_what_vllm_holds_after_the_reset() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, URL, MODEL)
    for message in history():
        feed.apply(message.events, message.data_parallel_rank or 0)
    # After the reset, only the last request (prompt 0 again) is cached: its 3 full blocks.
    assert len(feed) == 3 and feed.num_orphans == 0
    assert set(keys(PROMPTS[0])) == {feed.key_of(h) for h in history()[-1].events[1].block_hashes}


def test_a_salted_requests_blocks_are_keyed_by_its_salt_from_extra_keys() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, URL, MODEL)
    first, salted = history()[:2]
    feed.apply(first.events)
    feed.apply(salted.events)
    event = salted.events[0]
    assert isinstance(event, StoredBlocks) and event.extra_keys is not None
    assert event.extra_keys[0] == (SALT,)
    assert PROMPTS[1] == PROMPTS[0]  # same tokens: only the salt tells them apart
    assert [feed.key_of(h) for h in event.block_hashes] == list(keys(PROMPTS[1], SALT))
    assert set(keys(PROMPTS[1], SALT)).isdisjoint(keys(PROMPTS[0]))


def test_children_of_the_shared_prefix_chain_onto_its_keys() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, URL, MODEL)
    for message in history()[:4]:
        feed.apply(message.events)
    for idx in (2, 3):  # prompts that share prompt 0's first two blocks
        child = history()[idx].events[0]
        assert isinstance(child, StoredBlocks) and child.parent_block_hash is not None
        assert feed.key_of(child.block_hashes[0]) == keys(PROMPTS[idx])[2]


def test_evictions_remove_by_vllms_hash() -> None:
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, URL, MODEL)
    for message in history()[:-1]:  # up to the reset
        feed.apply(message.events)
    held = {feed.key_of(h) for m in history()[:-1] for e in m.events
            if isinstance(e, StoredBlocks) for h in e.block_hashes} - {None}
    assert keys(PROMPTS[1], SALT)[0] not in held  # the salted chain was evicted
    assert keys(PROMPTS[0])[2] not in held and keys(PROMPTS[0])[1] in held
    assert len(feed) == len(held)


@pytest.mark.parametrize("lost", [None, 5])
def test_the_recorded_stream_over_sockets_with_a_gap_ends_in_vllms_state(
        lost: int | None) -> None:
    """Publish the recording live from seq 1 (as vLLM's reached the recorder), losing batch
    `lost` too: the late join and the gap are replayed, and the index ends as the history's."""
    expected_policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    expected = WorkerIndexFeed(expected_policy, URL, MODEL)
    for message in history():
        expected.apply(message.events)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port, replay_port = free_port(), free_port()
        publisher = ScriptedPublisher(ctx, f"tcp://127.0.0.1:{port}",
                                      f"tcp://127.0.0.1:{replay_port}")
        policy = PrecisePolicy(max_pending_blocks_per_worker=0)

        async def model(_: str) -> str:
            return MODEL

        follower = ZmqEventFollower(
            {URL: EventSource(f"tcp://*:{port}", f"tcp://*:{replay_port}", "kv")}, policy,
            model)
        payloads = [frames[2] for via, frames in MESSAGES if via == "replay" and frames[2]]
        try:
            await publisher.recorded(0, payloads[0], live=False)
            follower.start()
            await asyncio.sleep(0.3)  # subscribed, replayed seq 0
            for seq, payload in enumerate(payloads[1:], start=1):
                await publisher.recorded(seq, payload, live=seq != lost)
            for _ in range(200):
                if follower.num_batches >= len(payloads):
                    break
                await asyncio.sleep(0.02)
            feed = follower.feeds[URL]
            assert len(feed) == len(expected) == 3
            assert {k for k in (feed.key_of(h) for m in history() for e in m.events
                                if isinstance(e, StoredBlocks) for h in e.block_hashes) if k} \
                == set(keys(PROMPTS[0]))
            assert policy.is_synced(URL) and URL not in follower.partial
            assert follower.num_gaps == (1 if lost else 0)
        finally:
            await follower.stop()
            await publisher.close()
            ctx.destroy(0)

    asyncio.run(main())
