"""The built-in cost profiles, by name, and `load_profile` (a name or a JSON file).

`h100`, `a100` (Llama-2-70B on one 4-GPU worker) and `h100-tp8`, `a100-tp8` (8 GPUs) are the
output of `splitwise_fit.fit_splitwise` on the Splitwise simulator's perf_model.csv (MIT,
(c) 2024 Pratyush Patel; where to get it: docs/traces.md), pinned here so the simulator needs no
trace files; a test refits them from the CSV. `zero` makes every step instantaneous (the
exactness check against `kvserve bench kvcache`). `kvserve` is the profile that
`python -m benchmarks profile` (a development harness, run from a clone) measured on this machine
(read from `MEASURED_PROFILE_PATH`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from kvserve.sim.costmodel import CostProfile

_SOURCE = ("Splitwise perf_model.csv (MIT, (c) 2024 Pratyush Patel): llama2-70b on {}x {}, "
           "105 rows")

MEASURED = "kvserve"
"""The name of the profile measured on this machine by `python -m benchmarks profile`."""


def measured_profile_path() -> Path:
    """Where `python -m benchmarks profile` writes by default: $KVSERVE_CACHE, else
    ~/.cache/kvserve."""
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache/kvserve")
    return root / "sim-profile.json"


BUILTIN: Mapping[str, CostProfile] = MappingProxyType({
    "h100": CostProfile(
        name="h100",
        source=_SOURCE.format(4, "h100-80gb"),
        prefill_floor_ms=49.6374,
        prefill_base_ms=8.2856,
        prefill_ms_per_token=0.10002857,
        prefill_ms_per_pair=3.263867e-06,
        decode_base_ms=28.9852,
        decode_ms_per_seq=0.314723,
        decode_ms_per_context_token=2.44537e-05,
        kv_capacity_tokens=457763,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        fit={"rows": 105.0, "prefill_mean_rel_err": 0.0431,
             "prefill_max_rel_err": 0.1788, "decode_mean_rel_err": 0.0167,
             "decode_max_rel_err": 0.073},
    ),
    "a100": CostProfile(
        name="a100",
        source=_SOURCE.format(4, "a100-80gb"),
        prefill_floor_ms=78.4244,
        prefill_base_ms=0.0,
        prefill_ms_per_token=0.26782346,
        prefill_ms_per_pair=0.0,
        decode_base_ms=43.8809,
        decode_ms_per_seq=0.380973,
        decode_ms_per_context_token=4.01766e-05,
        kv_capacity_tokens=457763,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        fit={"rows": 105.0, "prefill_mean_rel_err": 0.1176,
             "prefill_max_rel_err": 0.3637, "decode_mean_rel_err": 0.023,
             "decode_max_rel_err": 0.0872},
    ),
    "h100-tp8": CostProfile(
        name="h100-tp8",
        source=_SOURCE.format(8, "h100-80gb"),
        prefill_floor_ms=51.8443,
        prefill_base_ms=14.0388,
        prefill_ms_per_token=0.07358618,
        prefill_ms_per_pair=4.861987e-06,
        decode_base_ms=30.0015,
        decode_ms_per_seq=0.298508,
        decode_ms_per_context_token=1.22269e-05,
        kv_capacity_tokens=1336669,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        fit={"rows": 105.0, "prefill_mean_rel_err": 0.1142,
             "prefill_max_rel_err": 0.2932, "decode_mean_rel_err": 0.0225,
             "decode_max_rel_err": 0.0862},
    ),
    "a100-tp8": CostProfile(
        name="a100-tp8",
        source=_SOURCE.format(8, "a100-80gb"),
        prefill_floor_ms=65.7645,
        prefill_base_ms=3.2959,
        prefill_ms_per_token=0.17123802,
        prefill_ms_per_pair=0.0,
        decode_base_ms=44.5035,
        decode_ms_per_seq=0.369168,
        decode_ms_per_context_token=2.00883e-05,
        kv_capacity_tokens=1336669,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        fit={"rows": 105.0, "prefill_mean_rel_err": 0.0985,
             "prefill_max_rel_err": 0.3576, "decode_mean_rel_err": 0.0182,
             "decode_max_rel_err": 0.0751},
    ),
    "zero": CostProfile(
        name="zero",
        source="instantaneous compute: every step takes 0 s",
        prefill_floor_ms=0.0,
        prefill_base_ms=0.0,
        prefill_ms_per_token=0.0,
        prefill_ms_per_pair=0.0,
        decode_base_ms=0.0,
        decode_ms_per_seq=0.0,
        decode_ms_per_context_token=0.0,
        kv_capacity_tokens=1_000_000,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
    ),
})
"""Built-in profiles by name (read-only)."""

PROFILE_NAMES: tuple[str, ...] = (*BUILTIN, MEASURED)


def load_profile(name_or_path: str) -> CostProfile:
    """A built-in profile by name, the measured `kvserve` profile, or a JSON file. Raises
    ValueError saying what exists and how to make a missing measured profile."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path == MEASURED:
        path = measured_profile_path()
        if not path.exists():
            raise ValueError(f"no measured profile at {path}: run `python -m benchmarks profile` "
                             "first, from a clone of kvserve's repository")
        return CostProfile.from_file(path)
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"unknown profile {name_or_path!r}: use one of "
                         f"{', '.join(PROFILE_NAMES)} or a JSON file path")
    return CostProfile.from_file(path)
