"""Prefix keys: chained, tenant-salted, deterministic, and byte-identical to the engine's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.gateway.core.prefix import (
    RouteKey,
    canonical_chat,
    engine_block_hashes,
    engine_extra_keys,
    text_block_hashes,
)

tenants = st.none() | st.text(max_size=12)
texts = st.text(min_size=8, max_size=200)
token_lists = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=80)


@given(texts, tenants, st.integers(1, 16))
def test_text_hashes_cover_full_blocks_and_chain(text: str, tenant: str | None, bc: int) -> None:
    hashes = text_block_hashes(text, tenant, bc)
    assert len(hashes) == len(text) // bc
    assert all(len(h) == 32 for h in hashes)
    for k in range(len(hashes) + 1):  # a text's head of k blocks has the key's first k hashes
        assert text_block_hashes(text[: k * bc], tenant, bc) == hashes[:k]


@settings(max_examples=200)
@given(texts, tenants, tenants)
def test_salts_never_share_a_hash(text: str, tenant_a: str | None, tenant_b: str | None) -> None:
    if tenant_a == tenant_b:
        tenant_b = (tenant_a or "") + "x"
    a = RouteKey.from_text(text, tenant_a, block_chars=4)
    b = RouteKey.from_text(text, tenant_b, block_chars=4)
    assert a.prefix_hashes and not set(a.prefix_hashes) & set(b.prefix_hashes)


@given(token_lists, tenants, tenants, st.integers(1, 8))
def test_salts_never_share_exact_hashes(
    tokens: list[int], tenant_a: str | None, tenant_b: str | None, block_size: int
) -> None:
    if tenant_a == tenant_b:
        tenant_b = (tenant_a or "") + "x"
    a = RouteKey.from_token_ids(tokens, tenant_a, block_tokens=block_size)
    b = RouteKey.from_token_ids(tokens, tenant_b, block_tokens=block_size)
    assert not set(a.prefix_hashes) & set(b.prefix_hashes)
    assert a.num_tokens == len(tokens)


def test_no_salt_and_empty_salt_differ_and_block_size_is_folded_in() -> None:
    text = "x" * 64
    assert text_block_hashes(text, None, 8)[0] != text_block_hashes(text, "", 8)[0]
    assert not set(text_block_hashes(text, "t", 8)) & set(text_block_hashes(text, "t", 16))
    assert text_block_hashes("short", "t", 8) == ()


def test_chat_keys_keep_their_prefix_as_the_conversation_grows() -> None:
    turns: list[dict[str, object]] = [
        {"role": "system", "content": "You are a careful SQL debugger. " * 20},
        {"role": "user", "content": "Why is this query slow?", "id": "ignored"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    tools = [{"type": "function", "function": {"name": "explain", "parameters": {}}}]
    texts = [canonical_chat(turns[:k], tools) for k in range(len(turns) + 1)]
    assert all(texts[k + 1].startswith(texts[k]) for k in range(len(turns)))
    short = RouteKey.from_messages(turns[:1], "t", tools=tools, block_chars=32)
    full = RouteKey.from_messages(turns, "t", tools=tools, block_chars=32)
    assert full.prefix_hashes[: len(short.prefix_hashes)] == short.prefix_hashes
    # Tools are part of what the template renders, and so of the key; ids and key order are not.
    assert RouteKey.from_messages(turns, "t", block_chars=32) != full
    reordered = [dict(reversed(list(m.items()))) for m in turns]
    assert RouteKey.from_messages(reordered, "t", tools=tools, block_chars=32) == full
    assert "ignored" not in texts[-1]


def test_bad_input_is_a_value_error_that_says_why() -> None:
    with pytest.raises(ValueError, match="JSON-serialisable"):
        canonical_chat([{"role": "user", "content": object()}])
    with pytest.raises(ValueError, match="64-bit"):
        engine_block_hashes([2**63], block_size=1)
    with pytest.raises(ValueError, match="block_chars"):
        text_block_hashes("abc", None, 0)


def test_keys_are_identical_across_processes() -> None:
    code = (
        "from kvserve.gateway.core.prefix import RouteKey as K;"
        "print(K.from_text('abc' * 200, 'tenant-7').prefix_hashes[-1].hex(),"
        " K.from_token_ids(list(range(40)), 'tenant-7').prefix_hashes[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    here = (
        RouteKey.from_text("abc" * 200, "tenant-7").prefix_hashes[-1].hex(),
        RouteKey.from_token_ids(list(range(40)), "tenant-7").prefix_hashes[-1].hex(),
    )
    assert outputs == {" ".join(here) + "\n"}


# -- exact mode: the only place the gateway's tests touch kvserve.kvcache ------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=70),
    st.integers(1, 16),
    tenants,
    st.sampled_from(["", "demo", "Qwen/Qwen2.5-0.5B-Instruct"]),
)
def test_exact_hashes_are_byte_identical_to_the_kvcache_chain(
    tokens: list[int], block_size: int, salt: str | None, model_id: str
) -> None:
    from kvserve.kvcache import BlockStored, KVCacheManager
    from kvserve.kvcache.hashing import ROOT_HASH, chain_hashes, encode_extra_keys, encode_tokens

    assert engine_extra_keys(model_id, None, salt) == encode_extra_keys(model_id, None, salt)
    ours = engine_block_hashes(tokens, block_size, salt, model_id)
    num_full = len(tokens) // block_size
    reference, _ = chain_hashes(
        ROOT_HASH,
        encode_tokens(tokens[: num_full * block_size]),
        block_size * 8,
        encode_extra_keys(model_id, None, salt),
    )
    assert list(ours) == reference
    # And what a worker actually publishes once the KV is written.
    manager = KVCacheManager(128, block_size, enable_events=True, model_id=model_id)
    manager.add_request("r", tokens, cache_salt=salt)
    assert manager.allocate_slots("r", len(tokens)) is not None
    manager.commit("r", len(tokens))
    published = [
        h for e in manager.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert tuple(published) == ours
    assert RouteKey.from_token_ids(tokens, salt, block_tokens=block_size, model_id=model_id) == (
        RouteKey(ours, salt, len(tokens), block_size)
    )
