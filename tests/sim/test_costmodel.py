"""The cost model: its closed forms, its JSON, and the built-in profiles' provenance."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvserve.sim import CostProfile, StepShape, load_profile
from kvserve.sim.costmodel import attention_pairs
from kvserve.sim.profiles import BUILTIN
from kvserve.sim.splitwise_fit import fit_splitwise, weighted_lstsq
from tests.conftest import shared_file

SPLITWISE = {"h100": ("h100-80gb", 4), "a100": ("a100-80gb", 4),
             "h100-tp8": ("h100-80gb", 8), "a100-tp8": ("a100-80gb", 8)}


def test_attention_pairs_count_every_query_key_pair() -> None:
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 2) == 11 + 12
    assert attention_pairs(0, 8) == attention_pairs(0, 5) + attention_pairs(5, 3)


def test_a_decode_run_lasts_as_long_as_its_steps_one_by_one() -> None:
    profile = BUILTIN["h100"]
    seqs, context = 12, 40_000
    one_by_one = sum(profile.step_s(StepShape(0, 0, seqs, context + seqs * i))
                     for i in range(37))
    assert profile.decode_run_s(seqs, context, 37) == pytest.approx(one_by_one, rel=1e-12)
    assert profile.decode_run_s(seqs, context, 1) == profile.decode_step_s(seqs, context)


def test_prefill_steps_cost_their_floor_then_grow_with_tokens_and_pairs() -> None:
    profile = BUILTIN["h100"]
    tiny = profile.step_s(StepShape(16, attention_pairs(0, 16)))
    assert tiny == pytest.approx(profile.prefill_floor_ms / 1000)
    chunk = profile.step_s(StepShape(8192, attention_pairs(0, 8192)))
    late_chunk = profile.step_s(StepShape(8192, attention_pairs(20_000, 8192)))
    assert 0.5 < chunk < late_chunk < 2.0  # ~0.1 ms/token on 4x H100, plus attention
    assert BUILTIN["zero"].is_instant and not profile.is_instant


def test_profiles_round_trip_through_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(BUILTIN["a100"].to_json())
    assert load_profile(str(path)) == BUILTIN["a100"]
    path.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="incomplete profile"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("tpu-v9")


def test_weighted_least_squares_recovers_an_exact_line() -> None:
    rows = [(1.0, x, x * x) for x in (1.0, 2.0, 5.0, 9.0)]
    assert weighted_lstsq(rows, [3 + 2 * x + 0.5 * q for _, x, q in rows]) == pytest.approx(
        [3.0, 2.0, 0.5])


@pytest.mark.parametrize("name", sorted(SPLITWISE))
def test_builtin_profiles_are_the_fit_of_the_splitwise_measurements(name: str) -> None:
    csv = shared_file("traces/splitwise_sim/perf_model.csv")
    hardware, tp = SPLITWISE[name]
    fitted = fit_splitwise(csv, hardware, tp, name=name)
    assert fitted == BUILTIN[name]
    assert fitted.fit["decode_mean_rel_err"] < 0.05
    assert fitted.fit["prefill_mean_rel_err"] < 0.15


def test_measured_profile_fit_clamps_negative_coefficients() -> None:
    from benchmarks.profile_cli import _fit

    rows = [(1.0, float(x), 0.0) for x in (1, 2, 4, 8)]
    rows[2] = (1.0, 4.0, 1.0)  # a third feature that only adds noise, pulling negative
    coef = _fit(rows, [10 + 2 * x for _, x, _ in rows])
    assert all(c >= 0 for c in coef)


def test_profile_rejects_negative_coefficients() -> None:
    fields = {**{f: getattr(BUILTIN["zero"], f) for f in BUILTIN["zero"].__dataclass_fields__}}
    fields["decode_base_ms"] = -1.0
    with pytest.raises(ValueError, match="decode_base_ms"):
        CostProfile(**fields)


def test_reading_earlier_context_costs_per_token_and_old_profiles_still_load(
        tmp_path: Path) -> None:
    base = BUILTIN["h100"]
    reader = dataclasses.replace(base, prefill_floor_ms=0.0, prefill_ms_per_context_token=0.01)
    pairs = attention_pairs(1000, 256)
    early = reader.step_s(StepShape(256, pairs, prefill_context=0))
    late = reader.step_s(StepShape(256, pairs, prefill_context=1000))
    assert late - early == pytest.approx(1000 * 0.01 / 1000)
    # A profile written before these fields existed reads them as zero.
    old = json.loads(base.to_json())
    for name in ("prefill_ms_per_context_token", "request_overhead_ms",
                 "request_overhead_ms_per_prompt_token"):
        old.pop(name)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_profile(str(path))
    assert loaded.prefill_ms_per_context_token == loaded.request_overhead_ms == 0.0
    assert loaded.request_overhead_ms_per_prompt_token == 0.0


def test_the_request_overhead_adds_to_what_clients_see() -> None:
    from tests.sim.helpers import run, synthetic_trace

    workload = synthetic_trace(num_requests=5, rate_per_s=0.5)
    slow_api = dataclasses.replace(BUILTIN["zero"], request_overhead_ms=50.0)
    assert not slow_api.is_instant
    result = run(workload, profile=slow_api)
    assert result.num_ok == 5
    assert result.ttft_p50 == pytest.approx(0.05) and result.ttft_p99 == pytest.approx(0.05)


def test_the_request_overhead_grows_with_the_prompt() -> None:
    from tests.sim.helpers import run, synthetic_trace

    workload = synthetic_trace(num_requests=6, rate_per_s=0.5)
    per_token = dataclasses.replace(BUILTIN["zero"], request_overhead_ms=2.0,
                                    request_overhead_ms_per_prompt_token=0.01)
    assert not per_token.is_instant
    assert per_token.request_overhead_s(1000) == pytest.approx((2.0 + 10.0) / 1000)
    result = run(workload, profile=per_token)
    expected = sorted((2.0 + 0.01 * r.input_length) / 1000 for r in workload.requests)
    # Instant steps: each TTFT is exactly its own request's overhead.
    assert sorted(result.ttfts) == pytest.approx(expected)
    assert len({round(t, 9) for t in result.ttfts}) > 1  # the prompts differ in length


def test_the_overhead_fit_is_the_line_through_both_shapes() -> None:
    from benchmarks.profile_overhead import OverheadPoint, fit_overhead

    short = OverheadPoint("short", 65, ttft_ms=10.0, step_ms=5.0)  # 5 ms outside the step
    long = OverheadPoint("long", 2565, ttft_ms=25.0, step_ms=15.0)  # 10 ms outside
    base, per_token = fit_overhead(short, long)
    assert per_token == pytest.approx(5.0 / 2500)
    assert base + per_token * 65 == pytest.approx(5.0)
    # A long shape cheaper outside the step than the short one: no negative slope.
    assert fit_overhead(short, OverheadPoint("long", 2565, 12.0, 9.0)) == (pytest.approx(5.0),
                                                                          0.0)
    with pytest.raises(ValueError, match="more prompt tokens"):
        fit_overhead(long, short)
