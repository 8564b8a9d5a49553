"""Prometheus metrics: vLLM 0.32's families where vLLM has the metric (server/vllm_metrics.py,
with vLLM's names, types, labels and buckets), `kvserve:` names for the rest.

Engine counters are read from the engine's own snapshot at scrape time (so `/metrics` equals the
cache's books exactly); latencies are observed as requests finish. One registry per app.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvserve.kvcache import FreeReason, HostTierStats
from kvserve.runtime import AsyncEngine, RequestOutput
from kvserve.server.collective_metrics import CollectiveCollector
from kvserve.server.lora_metrics import LoRACollector
from kvserve.server.vllm.metrics import VLLMEngineFamilies, VLLMRequestMetrics

MAX_TENANT_LABELS = 32  # bounded label cardinality; later tenants share "other"


def tenant_label(tenant: str | None, cache_salt: str | None) -> str:
    """A metrics label for a tenant that never exposes its salt."""
    if tenant:
        return tenant[:64]
    if cache_salt:
        return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:8]
    return "none"


Metric = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


class EngineCollector(Collector):
    """Gauges and counters from the engine's latest snapshot, taken on its own thread."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.vllm = VLLMEngineFamilies(engine, model_name)

    def _gauge(self, name: str, doc: str, v: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], v)
        return g

    def _counter(self, name: str, doc: str, v: float) -> CounterMetricFamily:
        m = CounterMetricFamily(name, doc, labels=["model_name"])
        m.add_metric([self.model_name], v)
        return m

    def collect(self) -> Iterator[Metric]:
        kv, c = self.engine.stats.kv, self.engine.stats.kv.counters
        gauge, counter = self._gauge, self._counter
        yield from self.vllm.collect()
        yield gauge("kvserve:max_num_seqs", "Requests the running batch holds at most "
                    "(--max-num-seqs): what a gateway keeps in flight here, plus headroom.",
                    self.engine.info.limits.max_num_seqs)
        yield gauge("kvserve:kv_free_blocks", "Free blocks (uncached + cached).",
                    kv.num_free_blocks)
        yield gauge("kvserve:kv_cached_free_blocks", "Free blocks still hit-able.",
                    kv.num_cached_free_blocks)
        yield gauge("kvserve:kv_held_blocks", "Blocks held by live requests.", kv.num_held_blocks)
        yield gauge("kvserve:kv_blocks", "Blocks in the pool.", kv.num_blocks)
        yield gauge("kvserve:kv_live_requests", "Requests the cache ledger holds.",
                    kv.num_live_requests)
        yield gauge("kvserve:engine_up", "1 while the engine loop runs.",
                    1.0 if self.engine.is_running else 0.0)
        for name, doc, v in (
            ("kvserve:kv_allocated_blocks", "Blocks allocated.", c.allocated_blocks),
            ("kvserve:kv_freed_blocks", "Block references released.", c.freed_blocks),
            ("kvserve:kv_evicted_blocks", "Cached blocks evicted for reuse.", c.evicted_blocks),
            ("kvserve:kv_corruption_detections", "Blocks found reassigned under a live request.",
             c.corruption_detections),
            ("kvserve:kv_hash_collisions", "Hash matches refused by the token re-check.",
             c.hash_collisions),
            ("kvserve:kv_reclaimed_blocks", "Blocks reclaimed from requests nobody freed.",
             c.reclaimed_blocks),
            ("kvserve:kv_audit_runs", "Cache audits run.", c.audit_runs),
            ("kvserve:kv_idle_checks", "Idle checks of the cache from its counts.",
             c.idle_checks),
            ("kvserve:kv_audit_failures", "Cache audits that found a broken invariant.",
             c.audit_failures),
        ):
            yield counter(name, doc, v)
        frees = CounterMetricFamily("kvserve:kv_request_frees", "Requests whose blocks were "
                                    "freed, by reason.", labels=["model_name", "reason"])
        for reason in FreeReason:
            frees.add_metric([self.model_name, reason.value], c.frees_by_reason.get(reason, 0))
        yield frees
        for name, doc, v in (
            ("kvserve:kv_swap_outs", "Preemptions by swapping: KV copied to the host tier.",
             c.swapped_out_requests),
            ("kvserve:kv_swap_ins", "Swapped-out requests resumed: KV copied back.",
             c.swapped_in_requests),
            ("kvserve:kv_swap_fallbacks", "Swaps refused (host tier full) or lost (failed "
             "step): recomputed instead.", c.swap_fallbacks),
        ):
            yield counter(name, doc, v)
        for tier in (kv.host, kv.disk):
            if tier is not None:
                yield from self._tier_metrics("host" if tier is kv.host else "disk", tier)

    def _tier_metrics(self, name: str, tier: HostTierStats) -> Iterator[Metric]:
        """`kvserve:kv_host_*` or `kvserve:kv_disk_*`: one tier's census and counters."""
        gauge, counter = self._gauge, self._counter
        tc = tier.counters
        above = "device" if name == "host" else "host tier"
        p = f"kvserve:kv_{name}"
        for metric, doc, v in (
            (f"{p}_slots", f"Slots (blocks) in the {name} KV tier.", tier.num_slots),
            (f"{p}_free_slots", f"{name.title()} slots holding nothing.", tier.num_free_slots),
            (f"{p}_ready_slots", f"{name.title()} slots holding a hit-able block.",
             tier.num_ready_slots),
            (f"{p}_storing_slots", f"{name.title()} slots whose copy from the {above} is not "
             "yet confirmed.", tier.num_storing_slots),
            (f"{p}_pinned_slots", f"{name.title()} slots an in-flight load reads.",
             tier.num_pinned_slots),
            (f"{p}_swapped_slots", f"{name.title()} slots private to swapped-out requests.",
             tier.num_swapped_slots),
            (f"{p}_usage_perc", f"{name.title()} tier usage (1 = every slot used).", tier.usage),
        ):
            yield gauge(metric, doc, v)
        for metric, doc, v in (
            (f"{p}_hit_blocks", f"Prefix blocks served from the {name} tier.", tc.hit_blocks),
            (f"{p}_hit_tokens", f"Prompt tokens served from the {name} tier (also in "
             "vllm:prefix_cache_hits).", tc.hit_tokens),
            (f"{p}_stores", f"Blocks evicted from the {above} copied to the {name} tier.",
             tc.stores),
            (f"{p}_loads", f"{name.title()} blocks copied back to the device.", tc.loads),
            (f"{p}_evictions", f"{name.title()} blocks given up to make room.", tc.evictions),
            (f"{p}_dropped_stores", f"Blocks evicted from the {above} not kept: every {name} "
             "slot was busy.", tc.dropped_stores),
            (f"{p}_cancelled_copies", f"Copies into or out of the {name} tier undone before "
             "they were confirmed.", tc.cancelled_stores + tc.cancelled_loads),
            (f"{p}_hash_collisions", f"{name.title()} hash matches refused by the token "
             "re-check.", tc.hash_collisions),
            (f"{p}_swapped_out_blocks", f"Blocks of swapped-out requests copied to the {name} "
             "tier.", tc.swapped_out_blocks),
            (f"{p}_swapped_in_blocks", f"Blocks of swapped-out requests copied back from the "
             f"{name} tier.", tc.swapped_in_blocks),
        ):
            yield counter(metric, doc, v)


TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)


class TransferMetrics:
    """KV moved between workers (disaggregated prefill): blocks and bytes each way, blocks not
    sent because the decode worker held them, failures by cause, pull time."""

    def __init__(self, reg: CollectorRegistry, model_name: str) -> None:
        label = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=reg).labels(model_name)

        self.blocks_sent = counter("kvserve:kv_transfer_blocks_sent", "KV blocks sent to decode "
                                   "workers.")
        self.bytes_sent = counter("kvserve:kv_transfer_bytes_sent", "KV frame bytes sent.")
        self.blocks_received = counter("kvserve:kv_transfer_blocks_received", "KV blocks "
                                       "received from prefill workers and checksum-verified.")
        self.bytes_received = counter("kvserve:kv_transfer_bytes_received", "KV frame bytes "
                                      "received.")
        self.skipped_blocks = counter("kvserve:kv_transfer_skipped_blocks", "Prompt blocks not "
                                      "transferred: this decode worker already held them.")
        self.checksum_failures = counter("kvserve:kv_transfer_checksum_failures", "KV frames "
                                         "whose CRC32 did not match (the request failed).")
        self.failures = Counter("kvserve:kv_transfer_failures", "KV pulls that failed, by "
                                "cause.", ["model_name", "cause"], registry=reg)
        self.seconds = Histogram("kvserve:kv_transfer_seconds", "One KV stream, decode side: "
                                 "the prefill worker's answer (its KV ready) to the last block "
                                 "imported.", label, buckets=TRANSFER_BUCKETS,
                                 registry=reg).labels(model_name)
        self.pull_seconds = Histogram("kvserve:kv_pull_seconds", "One KV pull, decode side, "
                                      "end to end: the prefill included.", label,
                                      buckets=TRANSFER_BUCKETS, registry=reg).labels(model_name)
        self._model_name = model_name

    def failed(self, cause: str) -> None:
        self.failures.labels(self._model_name, cause).inc()


class ServerMetrics:
    """The app's registry and the per-request observations."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))
        self.registry.register(CollectiveCollector(engine, model_name))
        self.registry.register(LoRACollector(engine))
        label = ["model_name"]
        reg = self.registry
        self.vllm = VLLMRequestMetrics(reg, model_name, engine.info.limits.max_model_len)
        self.rejected = Counter("kvserve:requests_rejected", "Requests refused, by cause.",
                                ["model_name", "cause"], registry=reg)
        self.in_flight = Gauge("kvserve:requests_in_flight",
                               "Prompts admitted and not yet ended: what the 429 admission "
                               "limit (max_num_seqs + max waiting requests) counts.",
                               label, registry=reg)
        self.in_flight.labels(model_name).set(0)
        self.tenant_queries = Counter("kvserve:tenant_prefix_cache_queries",
                                      "Prompt tokens looked up, per tenant.",
                                      ["model_name", "tenant"], registry=reg)
        self.tenant_hits = Counter("kvserve:tenant_prefix_cache_hits",
                                   "Prompt tokens served from cache, per tenant.",
                                   ["model_name", "tenant"], registry=reg)
        self._tenants: set[str] = set()
        self.transfer = TransferMetrics(reg, model_name)

    def observe_token_gap(self, seconds: float) -> None:
        self.vllm.observe_token_gap(seconds)

    def refused(self, cause: str) -> None:
        """A request answered 429: kvserve's count by cause, and vLLM's admission rejection."""
        self.rejected.labels(self.model_name, cause).inc()
        self.vllm.rejected()

    def observe_finished(self, output: RequestOutput, tenant: str,
                         max_tokens: int | None = None) -> None:
        self.vllm.observe_finished(output, max_tokens)
        m = self.model_name
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            tenant = "other"
        self._tenants.add(tenant)
        self.tenant_queries.labels(m, tenant).inc(len(output.prompt_token_ids))
        self.tenant_hits.labels(m, tenant).inc(output.num_cached_tokens)
