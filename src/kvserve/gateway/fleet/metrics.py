"""Gateway metrics: decisions per worker and branch, retries, spills, rejections, added
latency, predicted vs achieved prefix hits (achieved from the workers' own counters), and how
the exact keys' tokenizer memo fares."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.gateway.core.retry_budget import RetryBudget
from kvserve.gateway.fleet.admission import Admission
from kvserve.gateway.fleet.foreign_load import ForeignLoad
from kvserve.gateway.fleet.token_source import ExactKeys
from kvserve.gateway.fleet.worker_pool import WorkerPool

ADDED_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                         5.0, 10.0)


class PoolCollector(Collector):
    """Per-worker state and the fleet's achieved prefix hit rate, read at scrape time."""

    def __init__(self, pool: WorkerPool, admission: Admission, budget: RetryBudget,
                 foreign: ForeignLoad | None = None, policy: str = "",
                 replica_safe: bool = True) -> None:
        self.pool = pool
        self.admission = admission
        self.budget = budget
        self.foreign = foreign
        self.policy = policy
        self.replica_safe = replica_safe

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        healthy = GaugeMetricFamily("kvserve:gateway_worker_healthy", "1 if the worker takes "
                                    "traffic.", labels=["worker"])
        in_flight = GaugeMetricFamily("kvserve:gateway_worker_in_flight", "Requests the gateway "
                                      "has open on the worker.", labels=["worker"])
        backlog = GaugeMetricFamily("kvserve:gateway_worker_prefill_backlog_tokens", "Prompt "
                                    "tokens sent to the worker and not yet answered, less "
                                    "those the policy expected cached.", labels=["worker"])
        waiting = GaugeMetricFamily("kvserve:gateway_worker_waiting", "The worker's queue, as "
                                    "last scraped.", labels=["worker"])
        hit_rate = GaugeMetricFamily("kvserve:gateway_worker_prefix_hit_rate", "The worker's "
                                     "prefix-cache hit rate (its own counters).",
                                     labels=["worker"])
        role = GaugeMetricFamily("kvserve:gateway_worker_role", "1 for the worker's role: both "
                                 "(unified), prefill or decode.", labels=["worker", "role"])
        foreign = GaugeMetricFamily("kvserve:gateway_worker_foreign_requests", "Requests the "
                                    "worker reported running, waiting or finished at the last "
                                    "scrape that this gateway did not send (at least): other "
                                    "routers', or direct clients'.",
                                    labels=["worker"])
        draining = GaugeMetricFamily("kvserve:gateway_worker_draining", "1 while the worker, "
                                     "gone from discovery, finishes the requests it has (it "
                                     "takes no new one; its series go once it has none).",
                                     labels=["worker"])
        hits = queries = 0.0
        for w in self.pool.workers.values():
            draining.add_metric([w.url], 1.0 if w.draining else 0.0)
            role.add_metric([w.url, w.role], 1.0)
            healthy.add_metric([w.url], 1.0 if w.healthy else 0.0)
            in_flight.add_metric([w.url], w.in_flight)
            backlog.add_metric([w.url], w.prefill_backlog_tokens)
            waiting.add_metric([w.url], w.num_waiting)
            foreign.add_metric([w.url], w.foreign)
            hit_rate.add_metric([w.url], w.prefix_hits / w.prefix_queries
                                if w.prefix_queries else 0.0)
            hits += w.prefix_hits
            queries += w.prefix_queries
        yield from (role, healthy, draining, in_flight, backlog, waiting, foreign, hit_rate)
        if self.foreign is not None:
            share = GaugeMetricFamily("kvserve:gateway_foreign_load_share", "Of the requests the "
                                      "workers reported over the last minute of scrapes "
                                      "(running and waiting, or finished: the larger), the "
                                      "share this gateway did not send (about (k-1)/k behind k "
                                      "replicas).", labels=["policy"])
            share.add_metric([self.policy], self.foreign.share)
            yield share
            shared = GaugeMetricFamily("kvserve:gateway_shared_workers", "1 once the gateway "
                                       "sees other routers' requests on its workers (see "
                                       "kvserve:gateway_foreign_load_share); replica_safe: "
                                       "whether its policy routes alike on every replica.",
                                       labels=["policy", "replica_safe"])
            shared.add_metric([self.policy, "true" if self.replica_safe else "false"],
                              1.0 if self.foreign.shared else 0.0)
            yield shared
        fleet = GaugeMetricFamily("kvserve:gateway_fleet_prefix_hit_rate", "Prefix-cache hit "
                                  "rate over all workers (achieved).")
        fleet.add_metric([], hits / queries if queries else 0.0)
        yield fleet
        queued = GaugeMetricFamily("kvserve:gateway_queued_requests", "Requests waiting for "
                                   "admission.")
        queued.add_metric([], self.admission.queued)
        yield queued
        limit = GaugeMetricFamily("kvserve:gateway_admission_limit", "Requests admitted at "
                                  "once now: --max-in-flight, or less once the workers' batch "
                                  "capacity is known.")
        limit.add_metric([], self.admission.limit)
        yield limit
        latency = self.admission.latency
        if latency is not None:
            adaptive = GaugeMetricFamily("kvserve:gateway_latency_limit", "The AIMD limit on "
                                         "requests in flight, from whether they start "
                                         "answering within their clients' timeouts.")
            adaptive.add_metric([], latency.limit)
            yield adaptive
            cuts = CounterMetricFamily("kvserve:gateway_latency_limit_cuts", "Times the "
                                       "latency limit was cut: a late first byte, or a client "
                                       "that left before its first byte.")
            cuts.add_metric([], latency.cuts)
            yield cuts
        balance = GaugeMetricFamily("kvserve:gateway_retry_budget_balance", "Retries available.")
        balance.add_metric([], self.budget.balance)
        yield balance


class TokenMemoCollector(Collector):
    """The exact keys' tokenizer memos (prompts and conversations), read at scrape time; nothing
    while the gateway has no keyer (no `--tokenizer`, or not resolved yet)."""

    def __init__(self, keys: ExactKeys) -> None:
        self.keys = keys

    def collect(self) -> Iterator[CounterMetricFamily]:
        keyer = self.keys.keyer
        if keyer is None:
            return
        lookups = CounterMetricFamily("kvserve:gateway_token_memo_lookups", "Exact-key "
                                      "tokenizations by prompt kind and memo outcome (splice: "
                                      "a memoized head reused; fallback: the overlap check "
                                      "refused it).", labels=["kind", "outcome"])
        chars = CounterMetricFamily("kvserve:gateway_token_memo_chars", "Characters to key, "
                                    "and characters the tokenizer actually ran over.",
                                    labels=["kind", "stage"])
        for kind, memo in (("prompt", keyer.prompt_memo), ("chat", keyer.chat_memo)):
            for outcome, count in memo.stats.counts.items():
                lookups.add_metric([kind, outcome.value], count)
            chars.add_metric([kind, "requested"], memo.stats.chars_requested)
            chars.add_metric([kind, "tokenized"], memo.stats.chars_tokenized)
        yield lookups
        yield chars


class GatewayMetrics:
    """The gateway's registry (one per app)."""

    def __init__(self, pool: WorkerPool, admission: Admission, budget: RetryBudget,
                 keys: ExactKeys | None = None, foreign: ForeignLoad | None = None,
                 policy: str = "", replica_safe: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        reg.register(PoolCollector(pool, admission, budget, foreign, policy, replica_safe))
        if keys is not None:
            reg.register(TokenMemoCollector(keys))
        self.requests = Counter("kvserve:gateway_requests", "Requests routed, by worker and "
                                "decision branch.", ["worker", "branch", "policy"], registry=reg)
        self.retries = Counter("kvserve:gateway_retries", "Requests re-sent to another worker "
                               "before the first byte.", ["reason"], registry=reg)
        self.retry_denied = Counter("kvserve:gateway_retry_budget_exhausted", "Retries refused "
                                    "by the retry budget.", registry=reg)
        self.resends = Counter("kvserve:gateway_resends", "Requests recognised as a client's "
                               "resend of one not yet answered (the same tenant, path and body "
                               "after a 429, a 504 or a client timeout): a retry storm's size.",
                               registry=reg)
        self.rejections = Counter("kvserve:gateway_rejections", "Requests answered 429/503 by "
                                  "the gateway.", ["reason"], registry=reg)
        self.deadline_expired = Counter("kvserve:gateway_deadline_expired", "Requests whose "
                                        "client's timeout passed before the worker started "
                                        "answering (closed upstream; 504 or an error event), "
                                        "by what was still awaited.", ["stage"], registry=reg)
        self.upstream_errors = Counter("kvserve:gateway_upstream_errors", "Failed upstream "
                                       "attempts.", ["worker", "kind"], registry=reg)
        self.predicted_hit_blocks = Counter("kvserve:gateway_predicted_hit_blocks", "Prefix "
                                            "blocks the policy expected the worker to hold.",
                                            registry=reg)
        self.added_latency = Histogram("kvserve:gateway_added_latency_seconds", "Time spent in "
                                       "the gateway before the request went upstream (parse, "
                                       "admission, routing).", buckets=ADDED_LATENCY_BUCKETS,
                                       registry=reg)

    def forget_worker(self, url: str) -> None:
        """The worker left the fleet: drop its labelled series (per-worker gauges are read
        from the pool, so they go with it)."""
        for counter in (self.requests, self.upstream_errors):
            names = counter._labelnames
            stale = {tuple(s.labels[n] for n in names) for family in counter.collect()
                     for s in family.samples if s.labels.get("worker") == url}
            for labelvalues in stale:
                counter.remove(*labelvalues)
