"""Engine sizing, with vLLM's names so users' knowledge carries over."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PreemptionMode(enum.Enum):
    """What preemption does with the victim's KV: free it and recompute it on resume, or swap
    it to the host tier and copy it back on resume (needs a host tier)."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits the scheduler keeps every step.

    `max_num_batched_tokens` is the token budget of one step (prefill chunks and decodes share
    it); `max_num_seqs` caps running requests; `max_model_len` caps prompt + output.
    `audit_interval_steps > 0` runs the full cache audit every that many steps.
    Whenever the engine drains, the idle check runs (O(live), from the cache's counts); the full
    audit runs on a drain too when at least `idle_audit_interval_s` seconds passed since the last
    one it ran on a drain (0: on every drain).
    `preemption_mode`: recompute (default) or swap (the cache must have a host tier).
    `max_loras`: distinct LoRA adapters one step may run (vLLM's `--max-loras`; the loaded
    slots); requests of other adapters wait, and later requests may go first meanwhile.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    audit_interval_steps: int = 0
    idle_audit_interval_s: float = 0.0
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    max_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.audit_interval_steps < 0:
            raise ValueError("audit_interval_steps must be >= 0 (0 turns the periodic audit off)")
        if not self.idle_audit_interval_s >= 0:
            raise ValueError(f"idle_audit_interval_s must be >= 0 (0: the full audit on every "
                             f"drain), got {self.idle_audit_interval_s}")
