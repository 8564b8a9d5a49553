"""The scheduler admits at most --max-loras distinct adapters a step (pure engine, no torch),
and the typed first-block fields hash requests without an adapter exactly as before."""

from __future__ import annotations

import hashlib

import pytest

from kvserve.engine import EngineCore, Request, SamplingParams, Scheduler, SchedulerConfig
from kvserve.engine.lora import AdapterRef
from kvserve.gateway.core.prefix import engine_extra_keys
from kvserve.kvcache import KVCacheManager
from kvserve.kvcache.hashing import encode_extra_keys
from tests.engine.toy_model import PagedToyModel


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, 1, hashlib.sha256(name.encode()).digest())


def test_at_most_max_loras_adapters_run_in_one_step_and_base_rows_fill_in() -> None:
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(256, 16, 128, 1, max_loras=2), kv)
    core = EngineCore(scheduler, PagedToyModel(64, 4))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plan = [("a1", "x"), ("a2", "y"), ("a3", "z"), ("b", None), ("a4", "x")]
    for rid, name in plan:
        core.add_request(Request(rid, [1, 2, 3, 4, 5], params,
                                 lora=ref(name) if name else None))
    out = scheduler.schedule(0.0)
    ran = {item.request.request_id for item in out.scheduled}
    assert ran == {"a1", "a2", "b", "a4"}  # z waits; base and x (already in) go ahead of it
    assert scheduler.num_waiting_for_adapter == 1 and scheduler.num_deferred == 0
    assert scheduler.counts().num_waiting_for_adapter == 1  # what /metrics exports
    assert len({i.request.lora.digest for i in out.scheduled if i.request.lora}) == 2
    while core.has_unfinished:
        core.step()
        adapters = {r.lora.digest for r in scheduler.running if r.lora is not None}
        assert len(adapters) <= 2
    assert kv.stats().num_held_blocks == 0


def test_requests_without_an_adapter_hash_byte_for_byte_as_before_adapters() -> None:
    """The gateway's precise policy and the KV-event consumers compare these bytes: the typed
    fields change nothing for the base model."""
    def legacy(*keys: str | None) -> bytes:  # the encoding before adapters had a typed field
        out = b""
        for key in keys:
            out += b"\xff\xff\xff\xff" if key is None else (
                len(key.encode()).to_bytes(4, "little") + key.encode())
        return out

    for model, salt in (("m", None), ("m", "tenant"), ("", ""), ("Qwen/x", "s" * 300)):
        assert encode_extra_keys(model, None, salt) == legacy(model, None, salt)
        assert engine_extra_keys(model, None, salt) == legacy(model, None, salt)
    digest = hashlib.sha256(b"w").digest()
    assert encode_extra_keys("m", digest, "s") == engine_extra_keys("m", digest, "s")
    assert encode_extra_keys("m", digest, None) != encode_extra_keys("m", None, digest.hex())
    with pytest.raises(TypeError, match="32-byte sha256"):
        encode_extra_keys("m", b"name", None)


def test_lora_settings_are_checked_as_vllm_does() -> None:
    from kvserve.runtime.engine_args import EngineArgs

    assert EngineArgs(enable_lora=True, tensor_parallel_size=2).enable_lora  # sharded (tests/tp)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert EngineArgs(enable_lora=True, max_loras=3).resolved_max_cpu_loras == 3
