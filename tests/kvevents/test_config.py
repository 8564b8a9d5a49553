"""`--kv-events-config` (vLLM's JSON shape) and the bind/connect rules of both ends."""

from __future__ import annotations

import pytest

from kvserve.kvevents.config import (
    KVEventsConfig,
    is_bind_endpoint,
    rank_endpoint,
    subscriber_address,
)


def test_vllms_json_shape_parses_with_its_defaults() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                      '"endpoint": "tcp://*:5557", "topic": "kv"}')
    assert config.is_enabled and config.replay_endpoint is None and config.buffer_steps == 10_000
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').is_enabled


@pytest.mark.parametrize(("text", "says"), [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"enable_kv_cache_events": true, "endpoit": "x"}', "unknown field.*endpoit.*valid"),
    ('{"enable_kv_cache_events": "yes"}', "true or false"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"endpoint": "tcp://nohost"}', "expected tcp://HOST:PORT"),
    ('{"replay_endpoint": 5}', "replay_endpoint must be a string"),
])
def test_a_bad_config_says_what_to_fix(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        KVEventsConfig.from_json(text)


def test_the_publisher_binds_wildcards_and_ipc_and_connects_to_a_host() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/kv")
    assert is_bind_endpoint("inproc://kv") and not is_bind_endpoint("tcp://10.0.0.2:5557")
    # ... so the subscriber connects to the worker's host, or binds the address given
    assert subscriber_address("tcp://*:5557", "10.0.0.5") == ("tcp://10.0.0.5:5557", False)
    assert subscriber_address("tcp://*:5557", "::1") == ("tcp://[::1]:5557", False)
    assert subscriber_address("tcp://10.0.0.2:5557", "10.0.0.5") == ("tcp://10.0.0.2:5557", True)


def test_data_parallel_ranks_offset_the_port() -> None:
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
