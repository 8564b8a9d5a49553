"""Every ending leaves zero held blocks; seeds are batch-independent; streams cancel cleanly."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine import FinishReason, SamplingParams
from kvserve.runtime import AsyncEngine
from tests.runtime.conftest import (
    assert_no_blocks_held,
    make_engine,
    random_prompt,
    run_to_completion,
)

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture
def llama(checkpoints):
    return checkpoints["llama_gqa"]


@pytest.mark.parametrize("after_steps", [0, 1, 3, 10])
def test_abort_at_any_step_frees_everything(llama, after_steps):
    engine = make_engine(llama, max_num_batched_tokens=8)
    for i in range(3):
        engine.add_request(f"r{i}", random_prompt(20, seed=i), LONG)
    for _ in range(after_steps):
        engine.step()
    engine.abort("r1")
    done = run_to_completion(engine)
    assert done["r1"].outputs[0].finish_reason is FinishReason.ABORT
    assert done["r0"].outputs[0].finish_reason is FinishReason.LENGTH
    assert_no_blocks_held(engine)


def test_deadline_ends_requests_and_frees_them(llama):
    engine = make_engine(llama, max_num_seqs=1)
    now = engine.clock()
    engine.add_request("late", random_prompt(12, seed=1), LONG, deadline=now - 1)
    engine.add_request("ok", random_prompt(12, seed=2), SamplingParams(max_tokens=3))
    done = run_to_completion(engine)
    assert done["late"].outputs[0].finish_reason is FinishReason.TIMEOUT
    assert done["ok"].outputs[0].finish_reason is not FinishReason.TIMEOUT
    assert_no_blocks_held(engine)


def test_corruption_fails_one_request_cleanly(llama):
    engine = make_engine(llama)
    engine.add_request("victim", random_prompt(12, seed=3), LONG)
    engine.add_request("bystander", random_prompt(12, seed=4), LONG)
    engine.step()
    block = engine.kv_cache.block_table("victim")[0]
    engine.kv_cache.pool.blocks[block].epoch += 1  # an eviction bug reassigned it
    done = run_to_completion(engine)
    victim = done["victim"].outputs[0]
    assert victim.finish_reason is FinishReason.ERROR and "corruption" in (victim.error or "")
    assert len(done["bystander"].outputs[0].token_ids) == 40
    assert engine.kv_cache.counters.corruption_detections == 1
    assert engine.kv_cache.stats().num_held_blocks == 0


def test_bad_requests_are_refused_and_queue_nothing(llama):
    engine = make_engine(llama, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="too long"):
        engine.add_request("big", random_prompt(40, seed=1))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", [1, 2, 10_000])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    assert not engine.has_unfinished
    assert_no_blocks_held(engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(llama):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    prompt = random_prompt(10, seed=42)
    alone = make_engine(llama)
    alone.add_request("s", prompt, seeded)
    expected = run_to_completion(alone)["s"].outputs[0].token_ids

    busy = make_engine(llama, max_num_batched_tokens=16, seed=99)
    for i in range(5):
        busy.add_request(f"noise{i}", random_prompt(5 + 3 * i, seed=i),
                         SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True))
    busy.step()
    busy.add_request("s", prompt, seeded)
    got = run_to_completion(busy)["s"].outputs[0].token_ids
    assert got == expected


def test_async_stream_cancellation_frees_blocks(llama):
    engine = make_engine(llama)
    async_engine = AsyncEngine(engine).start()

    async def scenario() -> list[int]:
        finished = []

        async def consume(rid: str, stop_after: int | None) -> None:
            count = 0
            async for output in async_engine.generate(rid, random_prompt(15, seed=len(rid)),
                                                      LONG):
                count += 1
                if output.finished:
                    finished.append(len(output.outputs[0].token_ids))
                if stop_after is not None and count >= stop_after:
                    break  # closing the stream aborts the request

        await asyncio.gather(consume("full", None), consume("drop", 2), consume("drop2", 5))
        return finished

    try:
        assert asyncio.run(scenario()) == [40]
        for _ in range(200):
            if async_engine.stats.kv.num_held_blocks == 0 and not engine.has_unfinished:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert async_engine.stats.kv.num_held_blocks == 0
    finally:
        async_engine.shutdown()
    assert_no_blocks_held(engine)


def test_async_refusal_raises_before_streaming(llama):
    async_engine = AsyncEngine(make_engine(llama, max_model_len=16)).start()

    async def scenario() -> None:
        async for _ in async_engine.generate("x", random_prompt(30, seed=1), LONG):
            pass

    try:
        with pytest.raises(ValueError, match="too long"):
            asyncio.run(scenario())
    finally:
        async_engine.shutdown()


@pytest.mark.parametrize("taken", [False, True])
def test_a_caller_that_leaves_before_the_engine_takes_its_request_leaves_nothing(llama, taken):
    """A client that disconnects while its request waits for the engine thread (busy with a
    long step) cancels the add. The engine thread must neither die of it (it did: setting
    the result of a cancelled future raised there) nor run the request for nobody."""
    import threading
    import time

    engine = make_engine(llama)
    async_engine = AsyncEngine(engine).start()
    busy, release = threading.Event(), threading.Event()

    def hold(_engine: object) -> None:  # the engine thread, in a long step
        busy.set()
        release.wait(10.0)

    async def scenario() -> None:
        held = asyncio.ensure_future(async_engine.call(hold))
        await asyncio.to_thread(busy.wait, 10.0)
        endless = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        gen = async_engine.generate("left", random_prompt(15, seed=3), endless)
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)  # the add is queued behind the long step
        if taken:  # the engine takes the add, and the caller leaves before it hears so
            release.set()
            end = time.monotonic() + 10.0
            while async_engine.num_live_requests == 0 and time.monotonic() < end:
                time.sleep(0.001)  # blocks this loop: the caller cannot resume meanwhile
            assert async_engine.num_live_requests == 1
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await held
        # the engine is alive and serves the next request
        outputs = [o async for o in async_engine.generate("next", random_prompt(9, seed=4),
                                                           LONG)]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 40
        # "left", 200 tokens long and sent first, is not still running for nobody
        assert async_engine.num_live_requests == 0

    try:
        asyncio.run(scenario())
        assert async_engine.is_running, async_engine.error
        for _ in range(200):
            if async_engine.stats.kv.num_held_blocks == 0 and not engine.has_unfinished:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert not engine.has_unfinished and async_engine.num_live_requests == 0
    finally:
        async_engine.shutdown()
    assert_no_blocks_held(engine)
