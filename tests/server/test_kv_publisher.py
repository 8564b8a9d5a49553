"""A kvserve worker publishes its KV events on vLLM's wire: frames, salt, replay, bad config."""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kvevents.config import KVEventsConfig
from kvserve.kvevents.wire import (
    END_OF_REPLAY_SEQ,
    AllCleared,
    RemovedBlocks,
    StoredBlocks,
    decode_message,
    decode_seq,
)
from kvserve.runtime.kv_event_log import KVEventLog
from kvserve.server.kv.publisher import ZmqKVEventPublisher
from tests.server.harness import free_port

H = [bytes([i]) * 32 for i in range(4)]


def test_each_step_is_one_batch_in_sequence_and_the_replay_gives_them_again() -> None:
    port, replay = free_port(), free_port()
    config = KVEventsConfig(True, "zmq", f"tcp://*:{port}", f"tcp://*:{replay}", topic="kv")
    publisher = ZmqKVEventPublisher(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    log = KVEventLog()
    log.set_publisher(publisher.publish)
    try:
        time.sleep(0.3)  # the SUB joins
        log.extend([BlockStored((H[0], H[1]), None, tuple(range(8)), 4, "salt-a")])
        log.extend([BlockRemoved((H[1],)), AllBlocksCleared()])
        log.extend([])  # no events: no batch
        got = [decode_message(sub.recv_multipart()) for _ in range(2)]
        assert [m.seq for m in got] == [0, 1] and {m.topic for m in got} == {"kv"}
        assert got[0].events == (StoredBlocks((H[0], H[1]), None, tuple(range(8)), 4, "GPU",
                                              None, (("salt-a",), None)),)
        assert got[1].events == (RemovedBlocks((H[1],), "GPU"), AllCleared())
        assert not sub.poll(200)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()[1:]
            if decode_seq(frames[1]) == END_OF_REPLAY_SEQ:
                break
            replayed.append(decode_message(frames))
        assert replayed == got[1:]
        dealer.close(0)
    finally:
        publisher.close()
        sub.close(0)
        ctx.destroy(linger=0)  # never blocks on a socket a failed assertion left open


def test_serve_refuses_a_bad_kv_events_config_before_loading_anything() -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve",
                           "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "hwm must be an integer >= 1" in done.stderr
