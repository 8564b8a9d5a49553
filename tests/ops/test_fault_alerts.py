"""The alert rules on the series a live worker exported under each planted fault (recorded by
tests/ops/test_live_faults.py into tests/data/fault_series; KVSERVE_RECORD_FAULT_SERIES=1 there
records them anew): promtool must fire exactly the alerts fault_expectations.py names for it,
and nothing else, at each point it checks. Runs without a live server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ops.fault_expectations import EXPECTED
from tests.ops.fault_series import RECORDINGS, Recording, check_alerts


def test_every_fault_has_a_recording() -> None:
    assert sorted(p.stem for p in RECORDINGS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_fault_fires_exactly_its_alerts(name: str, tmp_path: Path) -> None:
    recording = Recording.load(name)
    check_alerts(recording, EXPECTED[name](recording), tmp_path)


def test_folded_values_read_back_as_recorded(tmp_path: Path) -> None:
    scrapes = [{"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 0.0}, {"a": 2.5, "b": 1.0}, {"b": 1.0}, {},
               {"a": 3.0}]
    recording = Recording(names=set(), scrapes=scrapes)
    assert recording.series() == {"a": "1x1 2.5 stale _ 3", "b": "0x1 1x1 stale _"}
    recording.save("roundtrip", tmp_path)
    assert Recording.load("roundtrip", tmp_path).scrapes == scrapes
