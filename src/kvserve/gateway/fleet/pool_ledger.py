"""The live gateway's `Ledger`: a dispatch's counts on the worker pool, its metrics in the
gateway's Prometheus registry. The proxy and the Endpoint Picker share it."""

from __future__ import annotations

from kvserve.gateway.core.lifecycle import Ledger
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.worker_pool import WorkerPool


class PoolLedger(Ledger):
    """Counts on `pool`'s workers (in flight, dispatched, abandoned, backlog, answers) and
    metrics labelled with `policy_name`."""

    __slots__ = ("metrics", "policy_name", "pool")

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics, policy_name: str) -> None:
        self.pool = pool
        self.metrics = metrics
        self.policy_name = policy_name

    def count_sent(self, worker_id: str) -> None:
        worker = self.pool.get(worker_id)
        worker.in_flight += 1
        worker.dispatched += 1

    def count_ended(self, worker_id: str, finished: bool) -> None:
        worker = self.pool.get(worker_id)  # a worker holding a request is never forgotten
        if not finished:  # the worker may count it until it sees the disconnect
            worker.abandoned += 1
        self.pool.end_request(worker)  # last: a draining worker's last one lets it go

    def add_backlog(self, worker_id: str, tokens: int) -> None:
        self.pool.get(worker_id).prefill_backlog_tokens += tokens

    def record_added_latency(self, seconds: float) -> None:
        self.metrics.added_latency.observe(seconds)

    def record_routed(self, worker_id: str, branch: str) -> None:
        self.metrics.requests.labels(worker_id, branch, self.policy_name).inc()

    def record_answer(self, worker_id: str, branch: str, predicted_hit_blocks: int) -> None:
        self.pool.record_success(worker_id)
        worker = self.pool.workers.get(worker_id)
        if worker is not None:
            worker.requests += 1
        self.metrics.requests.labels(worker_id, branch, self.policy_name).inc()
        self.metrics.predicted_hit_blocks.inc(predicted_hit_blocks)

    def record_backpressure(self, worker_id: str) -> None:
        self.pool.record_backpressure(worker_id)

    def record_retry(self, reason: str) -> None:
        self.metrics.retries.labels(reason).inc()
