"""The cost model: its closed forms, its JSON, and the built-in profiles' provenance."""

from __future__ import annotations

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
    from kvserve.bench.profile_cli import _fit

    rows = [(1.0, float(x), 0.0) for x in (1, 2, 4, 8)]
    rows[2] = (1.0, 4.0, 1.0)  # a third feature that only adds noise, pulling negative
    coef = _fit(rows, [10 + 2 * x for _, x, _ in rows])
    assert all(c >= 0 for c in coef)


def test_profile_rejects_negative_coefficients() -> None:
    fields = {**{f: getattr(BUILTIN["zero"], f) for f in BUILTIN["zero"].__dataclass_fields__}}
    fields["decode_base_ms"] = -1.0
    with pytest.raises(ValueError, match="decode_base_ms"):
        CostProfile(**fields)
