"""Trace readers and token synthesis: equal id prefixes share tokens, nothing else does."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from kvserve.workload import (
    MultiTenantSpec,
    TraceFormatError,
    TraceRequest,
    load_trace,
    multi_tenant_trace,
    prompt_token_ids,
    write_mooncake_trace,
)
from tests.conftest import shared_file


def test_token_synthesis_shares_exactly_the_common_id_prefix():
    a = TraceRequest("a", 0, 10, 1, hash_ids=(7, 8, 9))
    b = TraceRequest("b", 0, 10, 1, hash_ids=(7, 8, 5))
    ta, tb = prompt_token_ids(a, 4), prompt_token_ids(b, 4)
    assert len(ta) == len(tb) == 10
    assert ta[:8] == tb[:8] and ta[8:] != tb[8:]
    assert ta[:4] == [28, 29, 30, 31]


def test_requests_without_prefix_data_get_unique_deterministic_prompts():
    a, b = TraceRequest("a", 0, 6, 1), TraceRequest("b", 0, 6, 1)
    assert prompt_token_ids(a, 4) == prompt_token_ids(a, 4)
    assert not set(prompt_token_ids(a, 4)) & set(prompt_token_ids(b, 4))


def test_mooncake_round_trip(tmp_path):
    reqs = [TraceRequest("x", 5.0, 600, 3, hash_ids=(1, 2)), TraceRequest("y", 9.0, 10, 1, (3,))]
    path = tmp_path / "t.jsonl"
    write_mooncake_trace(reqs, path)
    loaded = load_trace(path)
    assert [(r.arrival_ms, r.input_length, r.hash_ids) for r in loaded] == [
        (5.0, 600, (1, 2)), (9.0, 10, (3,))
    ]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", "{not json}\n", "bad.jsonl:1"),
        ("missing.jsonl", json.dumps({"timestamp": 0}) + "\n", "input_length"),
        ("zero.jsonl", json.dumps({"timestamp": 0, "input_length": 0, "output_length": 1,
                                   "hash_ids": []}) + "\n", "positive"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", "bad.csv:2"),
        ("trace.txt", "", "unknown trace type"),
    ],
)
def test_bad_traces_say_where_and_how_to_fix(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


def test_missing_trace_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file"):
        load_trace(tmp_path / "nope.jsonl")


def test_multi_tenant_trace_shares_prefixes_within_tenants_only():
    spec = MultiTenantSpec(num_tenants=3, num_requests=60, prefix_tokens=(2048, 4096), seed=1)
    reqs = multi_tenant_trace(spec)
    assert reqs == multi_tenant_trace(spec)  # deterministic
    by_tenant: dict[str, set[tuple[int, ...]]] = {}
    for r in reqs:
        prefix = r.hash_ids[: 4]
        by_tenant.setdefault(r.tenant or "", set()).add(prefix)
    assert all(len(prefixes) == 1 for prefixes in by_tenant.values())
    assert len({next(iter(p)) for p in by_tenant.values()}) == len(by_tenant)
    assert all(a.arrival_ms < b.arrival_ms for a, b in pairwise(reqs))


def test_skew_concentrates_traffic_on_the_first_tenant():
    reqs = multi_tenant_trace(MultiTenantSpec(num_tenants=8, num_requests=400, skew=2.0))
    hot = sum(r.tenant == "tenant-0" for r in reqs)
    assert hot > 400 * 0.5


def test_real_traces_load():
    mooncake = load_trace(shared_file("traces/mooncake/synthetic_trace.jsonl"), limit=50)
    assert len(mooncake) == 50 and all(r.hash_ids for r in mooncake)
    azure = load_trace(shared_file("traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"), 50)
    assert len(azure) == 50 and azure[0].arrival_ms == 0.0
    assert all(a.arrival_ms <= b.arrival_ms for a, b in pairwise(azure))
