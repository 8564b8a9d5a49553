"""How long a simulated worker's step takes: a cost model fitted from measurements.

A step's time depends only on its shape (`StepShape`). The form, in milliseconds:

- a step with any prefill token:
  max(prefill_floor, prefill_base + prefill_per_token * (prefill tokens + decode seqs)
      + prefill_per_pair * attention pairs + prefill_per_context_token * prefill context)
  + decode_per_context_token * decode context
- a decode-only step: decode_base + decode_per_seq * seqs + decode_per_context_token * context

"Attention pairs" of a chunk computing positions [s, s + n) are n * s + n (n + 1) / 2 (each new
token attends to every earlier one): the quadratic cost of long prompts and of suffixes on long
cached prefixes. "Prefill context" is the earlier tokens each prefill chunk reads (the sum of
the chunks' start positions): reading a long cached prefix costs per token, apart from the
attention arithmetic. `request_overhead_ms` + `request_overhead_ms_per_prompt_token` * prompt
tokens is what a request spends outside engine steps (HTTP in and out through the gateway, the
body's parsing and tokenization, the hand-off to the engine thread): added to the TTFT and
latency clients see. Profiles are JSON (`CostProfile.to_json`); see `profiles` for the built-in
ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Self


def attention_pairs(start: int, num_new_tokens: int) -> int:
    """Query-key pairs computed when positions [start, start + num_new_tokens) are computed."""
    n = num_new_tokens
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes: prefill tokens and their attention pairs, and decode
    sequences with the total context they attend to."""

    num_prefill_tokens: int = 0
    num_pairs: int = 0
    num_decode_seqs: int = 0
    decode_context: int = 0
    prefill_context: int = 0


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Coefficients of the step-time model (module docstring), plus the worker sizing that
    goes with the measured hardware. Immutable; every field is a plain number or string, so a
    profile round-trips through JSON unchanged. `fit` records how well the form matches the
    measurements it came from (relative errors, row counts)."""

    name: str
    source: str
    prefill_floor_ms: float
    prefill_base_ms: float
    prefill_ms_per_token: float
    prefill_ms_per_pair: float
    decode_base_ms: float
    decode_ms_per_seq: float
    decode_ms_per_context_token: float
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    fit: dict[str, float] = field(default_factory=dict)
    prefill_ms_per_context_token: float = 0.0
    request_overhead_ms: float = 0.0
    request_overhead_ms_per_prompt_token: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"profile {self.name!r}: {f.name} must be >= 0, got {value}")
        if min(self.kv_capacity_tokens, self.max_num_batched_tokens, self.max_num_seqs) < 1:
            raise ValueError(f"profile {self.name!r}: capacity and scheduler limits must be >= 1")

    @property
    def is_instant(self) -> bool:
        """True when every step takes zero time (the exactness check against the replay)."""
        return not any((self.prefill_floor_ms, self.prefill_base_ms, self.prefill_ms_per_token,
                        self.prefill_ms_per_pair, self.decode_base_ms, self.decode_ms_per_seq,
                        self.decode_ms_per_context_token, self.prefill_ms_per_context_token,
                        self.request_overhead_ms, self.request_overhead_ms_per_prompt_token))

    def step_s(self, shape: StepShape) -> float:
        """Seconds one step of this shape takes (>= 0)."""
        if shape.num_prefill_tokens == 0:
            return self.decode_step_s(shape.num_decode_seqs, shape.decode_context)
        ms = max(
            self.prefill_floor_ms,
            self.prefill_base_ms
            + self.prefill_ms_per_token * (shape.num_prefill_tokens + shape.num_decode_seqs)
            + self.prefill_ms_per_pair * shape.num_pairs
            + self.prefill_ms_per_context_token * shape.prefill_context,
        )
        return (ms + self.decode_ms_per_context_token * shape.decode_context) / 1000.0

    def request_overhead_s(self, num_prompt_tokens: int) -> float:
        """Seconds a request of `num_prompt_tokens` spends outside engine steps (>= 0)."""
        return (self.request_overhead_ms
                + self.request_overhead_ms_per_prompt_token * num_prompt_tokens) / 1000.0

    def decode_step_s(self, num_seqs: int, context: int) -> float:
        """Seconds of a decode-only step of `num_seqs` sequences attending to `context` tokens."""
        if num_seqs == 0:
            return 0.0
        ms = (self.decode_base_ms + self.decode_ms_per_seq * num_seqs
              + self.decode_ms_per_context_token * context)
        return ms / 1000.0

    def decode_run_s(self, num_seqs: int, context: int, num_steps: int) -> float:
        """Seconds of `num_steps` consecutive decode-only steps of a fixed batch whose context
        starts at `context` and grows by `num_seqs` tokens a step (closed form: the simulator
        fast-forwards such runs instead of stepping them one by one)."""
        first = self.decode_step_s(num_seqs, context)
        growth = self.decode_ms_per_context_token * num_seqs / 1000.0
        return num_steps * first + growth * num_steps * (num_steps - 1) / 2.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Build a profile from parsed JSON; raises ValueError naming a missing or odd field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown profile field(s) {', '.join(unknown)}; "
                             f"expected {', '.join(sorted(names))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"incomplete profile: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> Self:
        """Read a profile written by `to_json` (e.g. by `python -m benchmarks profile`)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read a cost profile ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cost profile is a JSON object")
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
