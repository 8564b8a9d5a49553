"""Engine test rig: EngineCore over the real cache and the paged toy model."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine import EngineCore, PreemptionMode, RequestDelta, Scheduler, SchedulerConfig
from kvserve.kvcache import AuditReport, KVCacheManager
from tests.engine.toy_model import CharDecoder, PagedToyModel


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    core: EngineCore
    kv: KVCacheManager
    model: PagedToyModel
    clock: Clock
    audits: list[AuditReport] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finished: dict[str, RequestDelta] = field(default_factory=dict)

    def step(self) -> list[RequestDelta]:
        deltas = self.core.step()
        for d in deltas:
            assert d.request_id not in self.finished, f"{d.request_id} produced after finishing"
            self.tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            self.text[d.request_id] = self.text.get(d.request_id, "") + d.new_text
            if d.finished:
                self.finished[d.request_id] = d
        self.clock.now += 0.01
        return deltas

    def drain(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.core.has_unfinished:
                return
            self.step()
        raise AssertionError("engine did not drain")


def make_rig(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 512,
    audit_interval_steps: int = 1,
    decoder: bool = False,
    num_host_slots: int = 0,
    idle_audit_interval_s: float = 0.0,
    num_disk_slots: int = 0,
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
) -> Rig:
    clock = Clock()
    kv = KVCacheManager(num_blocks, block_size, clock=clock, num_host_slots=num_host_slots,
                        num_disk_slots=num_disk_slots)
    config = SchedulerConfig(budget, max_num_seqs, max_model_len, audit_interval_steps,
                             idle_audit_interval_s, preemption_mode)
    model = PagedToyModel(num_blocks, block_size, num_host_slots, num_disk_slots)
    audits: list[AuditReport] = []
    core = EngineCore(Scheduler(config, kv), model, CharDecoder() if decoder else None, clock,
                      on_audit=audits.append)
    return Rig(core, kv, model, clock, audits)
