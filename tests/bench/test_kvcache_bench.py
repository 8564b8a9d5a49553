"""The kvcache replay benchmark: correct hit rates on workloads whose answer is known."""

from __future__ import annotations

import json

from kvserve.bench.kvcache_replay import replay_trace
from kvserve.cli import main
from kvserve.workload import TRACE_BLOCK_SIZE, TraceRequest, load_trace
from tests.conftest import shared_file


def test_replay_hit_rate_on_a_known_workload():
    # Three requests of 4 trace blocks (block 512); the second repeats the first's 3-block head.
    reqs = [
        TraceRequest("a", 0, 2048, 1, (1, 2, 3, 4)),
        TraceRequest("b", 1, 2048, 1, (1, 2, 3, 9)),
        TraceRequest("c", 2, 2048, 1, (5, 6, 7, 8)),
    ]
    result = replay_trace(reqs, capacity_tokens=1 << 20, block_size=16)
    assert result.hit_tokens == 3 * 512
    assert result.prompt_tokens == 3 * 2048
    assert result.rejected == 0 and result.evicted_blocks == 0


def test_replay_under_pressure_evicts_and_rejects_oversized_prompts():
    reqs = [TraceRequest(str(i), i, 1024, 1, (i, 100 + i)) for i in range(4)]
    reqs.append(TraceRequest("huge", 9, 4096, 1, (50, 51, 52, 53)))
    result = replay_trace(reqs, capacity_tokens=2048, block_size=16)
    assert result.rejected == 1 and result.hit_tokens == 0 and result.evicted_blocks > 0


def test_cli_json_on_the_mooncake_trace(capsys):
    trace = shared_file("traces/mooncake/synthetic_trace.jsonl")
    code = main(["bench", "kvcache", "--trace", str(trace), "--capacity-tokens", "2000000",
                 "--limit", "100", "--peer", "none", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert 0 < out["hit_rate"] < 1 and out["ops_per_s"] > 0 and out["requests"] == 100


def oracle_hit_tokens(requests: list[TraceRequest], block_size: int) -> int:
    """Hit tokens of an unbounded cache, computed from the trace ids alone (no hashing):
    sub-block k of trace block i is the same content wherever trace id hash_ids[i] appears."""
    per_trace_block = TRACE_BLOCK_SIZE // block_size
    seen: set[tuple[int, int]] = set()
    hits = 0
    for req in requests:
        keys = [(req.hash_ids[g // per_trace_block], g % per_trace_block)
                for g in range(req.input_length // block_size)]
        cap = (req.input_length - 1) // block_size
        n = 0
        while n < min(cap, len(keys)) and keys[n] in seen:
            n += 1
        hits += n * block_size
        seen.update(keys)
    return hits


def test_replay_equals_an_independent_oracle_on_the_real_trace():
    trace = load_trace(shared_file("traces/mooncake/synthetic_trace.jsonl"), limit=300)
    result = replay_trace(trace, capacity_tokens=10**7, block_size=16)
    assert result.evicted_blocks == 0
    assert result.hit_tokens == oracle_hit_tokens(trace, 16) > 0


def test_cli_multi_tenant_table(capsys):
    code = main(["bench", "kvcache", "--trace", "multi-tenant", "--requests", "30", "--tenants",
                 "2", "--capacity-tokens", "200000", "--peer", "none"])
    assert code == 0
    assert "200,000" in capsys.readouterr().out


def test_cli_bad_trace_is_a_clear_error(tmp_path, capsys):
    code = main(["bench", "kvcache", "--trace", str(tmp_path / "x.jsonl"),
                 "--capacity-tokens", "1000", "--peer", "none"])
    assert code == 2
    assert "no such trace file" in capsys.readouterr().err
