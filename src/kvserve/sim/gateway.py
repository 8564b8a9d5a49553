"""The gateway as the simulator runs it: the real routing policy object, fed the load signals the
production gateway sees, and its admission control.

Signals: `in_flight` is the gateway's own exact count per worker (it knows what it sent), and
so is the prefill backlog (prompt tokens sent and not yet answered with a first token, less what
the policy expected cached: gateway.forward keeps the same count); `num_running`, `num_waiting`
and `kv_usage` come from the last scrape of the workers' metrics, so they are up to one scrape
interval stale, as in production (gateway.scraper).
Admission is the gateway's own state machine (`gateway.admission_core`), driven from the
simulated clock: the same limits, queue order, waits and refusals, the same AIMD latency limit
with `latency_limit` (the gateway's default; it applies as the gateway applies it: only where
the workers do not declare their batch, `declared_batch=False`, as vLLM and SGLang do not), and
with `seniority` (also the gateway's default) a resend queued by when its request was first sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.gateway.admission_core import AdmissionLimits
from kvserve.gateway.policies import RouteRequest, RoutingPolicy, WorkerView
from kvserve.gateway.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S


@dataclass(frozen=True, slots=True)
class Backpressure:
    """Admission limits (the gateway's defaults) and the Retry-After it answers 429s with."""

    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 1.0
    retry_after_s: int = 1
    latency_limit: bool = True
    seniority: bool = True
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    declared_batch: bool = True  # the workers say their batch, as kvserve's do

    def __post_init__(self) -> None:
        self.limits()  # checks the bounds

    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_in_flight, self.max_queued, self.queue_timeout_s,
                               self.max_queue_wait_s, self.retry_after_s)


@dataclass(frozen=True, slots=True)
class Scraped:
    """One worker's metrics as of a scrape."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


class SimGateway:
    """Routes with `policy` over `worker_ids`; counts what it sent and what it refused."""

    def __init__(self, policy: RoutingPolicy, worker_ids: Iterable[str]) -> None:
        self.policy = policy
        self.worker_ids = tuple(worker_ids)
        self.in_flight = dict.fromkeys(self.worker_ids, 0)
        self.backlog_tokens = dict.fromkeys(self.worker_ids, 0)
        self.scraped = {w: Scraped() for w in self.worker_ids}
        self.num_in_flight = 0
        self.num_routed = 0
        self.num_throttled = 0  # 429s answered
        self.routed_by_worker = dict.fromkeys(self.worker_ids, 0)

    def update(self, worker_id: str, scraped: Scraped) -> None:
        """Record a scrape of one worker."""
        self.scraped[worker_id] = scraped

    def views(self) -> list[WorkerView]:
        """What a policy sees now: exact in-flight counts, scraped queue depth and KV usage."""
        return [
            WorkerView(w, True, self.in_flight[w], s.num_running, s.num_waiting, s.kv_usage,
                       self.backlog_tokens[w])
            for w in self.worker_ids
            for s in (self.scraped[w],)
        ]

    def route(self, request: RouteRequest) -> tuple[str, int]:
        """Choose a worker, tell the policy the request was sent, count it in flight. Returns
        the worker and the prefill backlog tokens counted for the request, which the caller
        hands back once: to `answered` at its first token, else to `release`."""
        decision = self.policy.route(request, self.views())
        worker_id = decision.worker_id
        self.policy.observe(request, worker_id)
        self.in_flight[worker_id] += 1
        backlog = request.uncached_tokens(decision.predicted_hit_blocks)
        self.backlog_tokens[worker_id] += backlog
        self.num_in_flight += 1
        self.num_routed += 1
        self.routed_by_worker[worker_id] += 1
        return worker_id, backlog

    def answered(self, worker_id: str, backlog_tokens: int) -> None:
        """The worker sent a request's first token: its prefill is no longer ahead of others."""
        assert 0 <= backlog_tokens <= self.backlog_tokens[worker_id], "backlog handed back twice"
        self.backlog_tokens[worker_id] -= backlog_tokens

    def release(self, worker_id: str, backlog_tokens: int = 0) -> None:
        """A request sent to `worker_id` finished, failed or was cancelled; `backlog_tokens`:
        its backlog if it was never `answered`."""
        assert self.in_flight[worker_id] > 0, f"release without a request in flight on {worker_id}"
        self.answered(worker_id, backlog_tokens)
        self.in_flight[worker_id] -= 1
        self.num_in_flight -= 1
