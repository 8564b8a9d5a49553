"""An adapter's KV is identified by what the adapter is (the sha256 of its weights and config),
never by its name or id: each test reproduces a bug class seen in the field and shows it
cannot occur in kvserve (docs/design.md, the adapter-identity invariant).

- vLLM #30931: one adapter name under two ids (other weights) shared KV blocks.
- vLLM #42125: an adapter reloaded under the same name kept hitting the old weights' blocks.
- vLLM #44701: an adapter name and a cache_salt of the same string collided.
- vLLM #44250: a KV transfer key (connector) left the adapter out: here P/D and the host tier.
- llm-d-router #2927: the adapter in `extra_keys` was misparsed, so LoRA blocks never matched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvserve.engine import SamplingParams
from kvserve.gateway.core.prefix import engine_block_hashes
from kvserve.gateway.fleet.event_index import WorkerIndexFeed
from kvserve.kvevents.wire import StoredBlocks, decode_batch, encode_batch
from kvserve.model import write_random_checkpoint
from kvserve.model.lora import load_peft_adapter
from kvserve.runtime import EngineArgs, LLMEngine
from kvserve.runtime.kv_transfer import export_prompt_blocks, prompt_block_hashes
from kvserve.server.kv.publisher import wire_event
from tests.lora.adapters import write_peft_adapter
from tests.model.arch_configs import base_config
from tests.runtime.conftest import random_prompt

pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = random_prompt(17, seed=9)  # 4 full blocks of 4, the last token computed
BLOCK = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-identity")
    base = write_random_checkpoint(root / "base", base_config(), seed=3)
    out = {"base": base, "A": write_peft_adapter(base, root / "A", rank=8, seed=1),
           "B": write_peft_adapter(base, root / "B", rank=8, seed=2)}
    out["A_copy"] = Path(shutil.copytree(out["A"], root / "A_copy"))
    return out


def engine(files: dict[str, Path], **overrides: object) -> LLMEngine:
    args: dict[str, object] = dict(model=str(files["base"]), block_size=BLOCK,
                                   num_kv_blocks=64, num_threads=1, enable_lora=True,
                                   max_loras=2, audit_interval_steps=1)
    args.update(overrides)
    return LLMEngine.from_args(EngineArgs(**args))  # type: ignore[arg-type]


def run(eng: LLMEngine, request_id: str, lora=None, salt: str | None = None,
        prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from cache) of one request run alone."""
    eng.add_request(request_id, prompt, GREEDY, lora=lora, cache_salt=salt)
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                result = (out.outputs[0].token_ids, out.num_cached_tokens)
    return result


def reference(files: dict[str, Path], adapter: str) -> list[int]:
    eng = engine(files)
    assert eng.lora is not None
    return run(eng, "ref", eng.lora.add(adapter, str(files[adapter])).ref)[0]


def test_30931_one_name_under_two_ids_never_shares_blocks_of_other_weights(files) -> None:
    eng = engine(files)
    assert eng.lora is not None
    first = eng.lora.resolve_request("x", str(files["A"]), 1)
    run(eng, "a", first)
    second = eng.lora.resolve_request("x", str(files["B"]), 2)  # same name, another id + files
    tokens, cached = run(eng, "b", second)
    assert cached == 0
    assert tokens == reference(files, "B")
    same = eng.lora.resolve_request("x", str(files["B"]), 3)  # same files under a third id
    assert run(eng, "c", same)[1] == 16  # shares: what it computes is the same KV


def test_42125_a_name_reloaded_with_other_weights_starts_a_new_chain(files) -> None:
    eng = engine(files)
    assert eng.lora is not None
    run(eng, "old", eng.lora.add("x", str(files["A"])).ref)
    eng.lora.remove("x")
    tokens, cached = run(eng, "new", eng.lora.add("x", str(files["B"])).ref)
    assert cached == 0
    assert tokens == reference(files, "B")


def test_two_names_of_the_same_files_share_their_blocks(files) -> None:
    eng = engine(files)
    assert eng.lora is not None
    run(eng, "x", eng.lora.add("x", str(files["A"])).ref)
    tokens, cached = run(eng, "y", eng.lora.add("y", str(files["A_copy"])).ref)
    assert cached == 16
    assert tokens == reference(files, "A")


def test_44701_an_adapter_name_and_a_salt_of_the_same_string_never_collide(files) -> None:
    eng = engine(files)
    assert eng.lora is not None
    ref = eng.lora.add("tenant-a", str(files["A"])).ref
    run(eng, "lora", ref)
    assert run(eng, "salted", None, salt="tenant-a")[1] == 0  # base model, salt = the name
    assert run(eng, "both", ref, salt="tenant-a")[1] == 0  # the adapter, salted
    assert run(eng, "plain", None)[1] == 0  # the base model, unsalted
    assert run(eng, "again", ref)[1] == 16  # ... while the adapter's own chain still hits


def test_44250_pd_transfer_keys_carry_the_adapter(files) -> None:
    """The prefill side exports a prompt's blocks by the keys the decode side sends: computed
    under an adapter, they are found only under that adapter's digest."""
    eng = engine(files)
    assert eng.lora is not None
    ref = eng.lora.add("x", str(files["A"])).ref
    run(eng, "p", ref)
    digest = load_peft_adapter(files["A"], eng.runner.model.config, 16, __import__(
        "torch").float32).digest  # the adapter's own digest, from its files
    assert export_prompt_blocks(eng, PROMPT, None, 0, 4, digest) is not None
    assert export_prompt_blocks(eng, PROMPT, None, 0, 4, None) is None  # never as the base's
    assert prompt_block_hashes(eng.info, PROMPT, None, 4, digest) != prompt_block_hashes(
        eng.info, PROMPT, None, 4, None)


def test_44250_the_host_tier_keeps_the_adapter_in_its_keys(files) -> None:
    """Blocks offloaded to the host tier under an adapter are hit only by that adapter: not by
    the base model, not by the same name reloaded with other weights."""
    eng = engine(files, num_kv_blocks=12, kv_host_tier_bytes=1 << 20)
    assert eng.lora is not None
    old = eng.lora.add("x", str(files["A"])).ref
    run(eng, "a", old)
    for i in range(3):  # push the adapter's blocks out of the device pool into the host tier
        run(eng, f"fill{i}", None, prompt=random_prompt(33, seed=100 + i))
    host = eng.kv_cache.stats().host
    assert host is not None and host.counters.hit_tokens == 0
    assert run(eng, "base", None)[1] == 0
    eng.lora.remove("x")
    tokens, cached = run(eng, "reloaded", eng.lora.add("x", str(files["B"])).ref)
    assert cached == 0 and tokens == reference(files, "B")
    tokens, cached = run(eng, "again", old)  # the old weights' request still hits its own
    host = eng.kv_cache.stats().host
    assert cached == 16 and host is not None and host.counters.hit_tokens >= 16
    assert tokens == reference(files, "A")


def test_2927_the_event_consumer_keys_lora_blocks_as_the_worker_hashes_them(files) -> None:
    eng = engine(files)
    assert eng.lora is not None
    events: list[object] = []
    eng.kv_events.set_publisher(events.extend)
    ref = eng.lora.add("x", str(files["A"])).ref
    tokens, _ = run(eng, "a", ref, salt="tenant")
    wire = [wire_event(e, eng.lora.name_of) for e in events]  # type: ignore[arg-type]
    _, decoded, _ = decode_batch(encode_batch(0.0, wire))
    stored = [e for e in decoded if isinstance(e, StoredBlocks)]
    assert stored and all(e.lora_name == "x" for e in stored)

    class Sink:
        keys: list[bytes] = []

        def apply_events(self, worker_id, stored=(), removed=(), cleared=False) -> None:
            self.keys.extend(stored)

    sink = Sink()
    feed = WorkerIndexFeed(sink, "w", eng.model_name, BLOCK)
    feed.apply(decoded)
    digest = load_peft_adapter(files["A"], eng.runner.model.config, 16, __import__(
        "torch").float32).digest
    worker = engine_block_hashes(PROMPT + tokens, BLOCK, "tenant", eng.model_name, digest)
    assert sink.keys == list(worker)  # the consumer keys the blocks as the worker hashed them
    assert worker != engine_block_hashes(PROMPT, BLOCK, "tenant", eng.model_name, None)
    assert feed.num_orphans == 0
