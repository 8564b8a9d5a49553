"""What a simulation run reports, as plain data: figures per run, a timeline and per worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TimelineSample:
    """The fleet at one scrape: per-worker load (running + waiting) and gateway in-flight
    counts, and the fleet's cumulative prefix-cache query and hit tokens."""

    t: float
    load: tuple[int, ...]
    in_flight: tuple[int, ...]
    query_tokens: int
    hit_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerSummary:
    """One worker over the run."""

    worker_id: str
    routed: int  # attempts the gateway sent it
    utilization: float  # busy time / makespan
    steps: int
    preemptions: int
    computed_tokens: int
    wasted_tokens: int  # computed for attempts that were then cancelled
    hit_rate: float
    queried_tokens: int  # prompt tokens looked up in its cache (vLLM's prefix_cache_queries)
    evicted_blocks: int
    audit_ok: bool
    held_blocks_at_end: int
    adapter_loads: int = 0  # LoRA adapters loaded into its slots


@dataclass(slots=True)
class SimResult:
    """One policy on one workload. Latencies are seconds from the user's first send (retries
    and 429 waits included), over the requests that were answered. `hit_rate` is the fleet's
    prefix-cache hit tokens / query tokens, as vLLM's metrics count them (every admission,
    re-admissions after preemption or retry included)."""

    label: str
    policy: str
    workload: str
    profile: str
    num_workers: int
    capacity_tokens: int
    retries: bool
    backpressure: bool
    num_requests: int
    num_ok: int
    num_gave_up: int
    num_rejected: int
    hit_rate: float
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    slo_s: float
    slo_attainment: float  # share of all requests with a first token within slo_s
    requests_per_s: float
    output_tokens_per_s: float
    utilization_mean: float
    utilization_max: float
    num_preemptions: int
    num_retries: int
    num_throttled: int
    num_attempts: int  # sent to workers
    computed_tokens: int
    wasted_tokens: int
    makespan_s: float
    wall_s: float
    num_events: int
    audit_ok: bool
    adapter_loads: int = 0  # LoRA adapters loaded into a worker's slot, fleet-wide
    adapter_loads_per_request: float = 0.0  # over the requests answered
    workers: list[WorkerSummary] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    timeline: list[TimelineSample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Every scalar figure (no per-request or per-sample lists)."""
        out = asdict(self)
        for key in ("workers", "ttfts", "timeline"):
            out.pop(key)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready."""
        out = self.summary()
        out["workers"] = [asdict(w) for w in self.workers]
        out["ttfts"] = [round(t, 6) for t in self.ttfts]
        out["timeline"] = [asdict(s) for s in self.timeline]
        return out
