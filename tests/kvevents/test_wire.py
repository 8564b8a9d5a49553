"""vLLM's KV-event wire: both event encodings, batches, frames, and malformed input."""

from __future__ import annotations

import msgpack
import pytest

from kvserve.kvevents.wire import (
    AllCleared,
    RemovedBlocks,
    StoredBlocks,
    WireError,
    decode_batch,
    decode_event,
    decode_message,
    encode_batch,
    encode_message,
)

TOKENS = list(range(8))


def test_tagged_arrays_decode_by_field_order_with_trailing_defaults_left_out() -> None:
    # An older vLLM: tag first, then block_hashes, parent, token_ids, block_size, lora_id[, medium]
    old = decode_event(["BlockStored", [11, 12], None, TOKENS, 4, None])
    assert old == StoredBlocks((11, 12), None, tuple(TOKENS), 4, "GPU")
    newer = decode_event(["BlockStored", [13], 12, TOKENS[:4], 4, None, "CPU", None,
                          [["salt"]], 0, "full", None, None, None, "sess", "future-field"])
    assert newer == StoredBlocks((13,), 12, tuple(TOKENS[:4]), 4, "CPU", None, (("salt",),))
    assert decode_event(["BlockRemoved", [11], "GPU"]) == RemovedBlocks((11,), "GPU")
    assert decode_event(["BlockRemoved", [11]]) == RemovedBlocks((11,), None)
    assert decode_event(["AllBlocksCleared"]) == AllCleared()


def test_maps_with_a_type_key_decode_and_unknown_fields_are_ignored() -> None:
    event = decode_event({"type": "BlockStored", "block_hashes": [b"\x01" * 32],
                          "parent_block_hash": None, "token_ids": TOKENS[:4], "block_size": 4,
                          "lora_id": None, "medium": "cpu", "lora_name": "ad",
                          "extra_keys": [["ad", "s1"]], "group_idx": 0, "new_in_vllm_9": 1})
    assert event == StoredBlocks((b"\x01" * 32,), None, tuple(TOKENS[:4]), 4, "CPU", "ad",
                                 (("ad", "s1"),))
    assert decode_event({"type": "BlockRemoved", "block_hashes": [5],
                         "medium": None}) == RemovedBlocks((5,), None)
    assert decode_event({"type": "AllBlocksCleared"}) == AllCleared()


def test_encode_then_decode_is_the_identity_on_frames() -> None:
    events = [StoredBlocks((1, 2), None, tuple(TOKENS), 4, "GPU", None, (("s",), None)),
              RemovedBlocks((1,), "GPU"), AllCleared()]
    frames = encode_message("kv", 7, encode_batch(12.5, events, 1))
    message = decode_message(frames)
    assert (message.topic, message.seq, message.ts, message.data_parallel_rank) == ("kv", 7,
                                                                                    12.5, 1)
    assert list(message.events) == events
    assert frames[1] == (7).to_bytes(8, "big")
    assert msgpack.unpackb(frames[2])[1][0]["type"] == "BlockStored"  # maps, as vLLM 0.32


def test_a_batch_without_its_rank_decodes() -> None:
    assert decode_batch(msgpack.packb([1.0, []])) == (1.0, (), None)


@pytest.mark.parametrize(("frames", "says"), [
    ([b"kv", b"\x00" * 8], "3 frames"),
    ([b"kv", b"\x00" * 4, msgpack.packb([1.0, []])], "8"),
    ([b"kv", b"\x00" * 8, b"\xc1"], "msgpack"),
    ([b"kv", b"\x00" * 8, msgpack.packb({"ts": 1})], "array"),
    ([b"kv", b"\x00" * 8, msgpack.packb(["x", []])], "timestamp"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [["Nope"]]])], "unknown KV event type"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockRemoved",
                                                "block_hashes": [-1]}]])], "uint64"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 4,
                                                None]]])], "token ids"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0,
                                                None]]])], "block_size"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [["BlockRemoved", []]]])], "non-empty"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [7]])], "tagged array or a map"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [], -2])], "data_parallel_rank"),
])
def test_malformed_messages_say_what_is_wrong(frames: list[bytes], says: str) -> None:
    with pytest.raises(WireError, match=says):
        decode_message(frames)
