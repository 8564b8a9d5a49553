"""vLLM 0.32's metric families, as kvserve workers export them: vLLM's names, types, label names
(`engine`, `model_name`, ...) and bucket bounds, so vLLM's dashboards, the Gateway API Inference
Extension's model-server protocol and PromQL written for vLLM read kvserve workers unchanged,
and histograms of both kinds of worker aggregate by `le`.

`VLLMEngineFamilies` reads the engine's snapshot at scrape time; `VLLMRequestMetrics` observes
each request as it finishes. The families kvserve has no quantity for (multimodal cache, KV
connector, sleep mode, FLOP estimates) are absent, never exported as zeros; tests/server/
test_vllm_metrics.py lists them with the reason each.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvserve.engine import FinishReason
from kvserve.runtime import AsyncEngine, RequestOutput

ENGINE = "0"  # vLLM's data-parallel engine index; a kvserve worker runs one engine
LABELS = ["engine", "model_name"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's finish reasons, all exported from the start (kvserve's are their OpenAI names, a
# subset: a timeout is "abort")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class VLLMEngineFamilies:
    """The engine-state families, from one snapshot (gauges, counters, cache_config_info,
    iteration_tokens_total)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                doc: str, value: float) -> GaugeMetricFamily | CounterMetricFamily:
        family = kind(name, doc, labels=LABELS)
        family.add_metric([ENGINE, self.model_name], value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily
                                  | HistogramMetricFamily]:
        stats = self.engine.stats
        kv, c = stats.kv, stats.kv.counters
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "vllm:num_requests_running",
                           "Number of requests in model execution batches.", stats.num_running)
        yield self._family(gauge, "vllm:num_requests_waiting",
                           "Number of requests waiting to be processed.", stats.num_waiting)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Waiting requests by reason: 'capacity' = "
            "waiting for KV blocks or a batch slot; 'deferred' = waiting for blocks another "
            "running request is computing (to hit them rather than compute them twice).",
            labels=[*LABELS, "reason"])
        waiting.add_metric([ENGINE, self.model_name, "capacity"],
                           stats.num_waiting - stats.num_waiting_deferred)
        waiting.add_metric([ENGINE, self.model_name, "deferred"], stats.num_waiting_deferred)
        yield waiting
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                           "percent usage (evictable cached blocks count as free).", kv.usage)
        yield self._family(counter, "vllm:prefix_cache_queries", "Prefix cache queries, in "
                           "terms of number of queried tokens.", c.prefix_queries_tokens)
        yield self._family(counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                           "number of cached tokens.", c.prefix_hits_tokens)
        yield self._family(counter, "vllm:num_preemptions", "Cumulative number of preemption "
                           "from the engine.", stats.num_preemptions)
        tiers = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier "
            "that supplied them: device, host (the host tier), disk (the disk tier).",
            labels=[*LABELS, "source"])
        host = kv.host.counters.hit_tokens if kv.host else 0
        disk = kv.disk.counters.hit_tokens if kv.disk else 0
        for source, value in (("device", max(c.prefix_hits_tokens - host - disk, 0)),
                              ("host", host), ("disk", disk)):
            tiers.add_metric([ENGINE, self.model_name, source], value)
        yield tiers
        yield self._cache_config_info()
        if stats.step_tokens is not None:
            steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number "
                                          "of tokens per engine_step.", labels=LABELS)
            steps.add_metric([ENGINE, self.model_name], stats.step_tokens.cumulative(),
                             stats.step_tokens.total)
            yield steps

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM's 37 CacheConfig labels: kvserve's values where it has the setting, vLLM's
        value for a model without it (no Mamba, no sliding window) otherwise."""
        info = self.engine.info
        kv = self.engine.stats.kv
        args = info.args
        tokens = kv.num_blocks * kv.block_size
        host_slots = str(kv.host.num_slots) if kv.host else "None"
        labels = {
            "_block_size_resolved": "True", "block_size": str(kv.block_size),
            "cache_dtype": args.kv_cache_dtype, "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(kv.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(args.enable_prefix_caching), "engine": ENGINE,
            "gpu_memory_utilization": "None", "hash_block_size": "None",
            "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(round(tokens / info.limits.max_model_len, 2)),
            "kv_cache_memory_bytes": str(args.kv_cache_memory_bytes),
            "kv_cache_size_tokens": str(tokens),
            "kv_offloading_backend": "native" if kv.host else "None",
            "kv_offloading_size": str(args.kv_host_tier_bytes) if kv.host else "None",
            "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
            "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": host_slots, "num_gpu_blocks": str(kv.num_blocks),
            "num_gpu_blocks_override": str(args.num_kv_blocks),
            "prefix_cache_retention_interval": "0", "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None", "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None", "sliding_window": "None",
            "swa_bounded_replay": "True", "use_kda_recoverssm": "False",
            "use_replayssm": "False", "user_specified_block_size": "True",
        }
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=sorted(labels))
        info.add_metric([labels[k] for k in sorted(labels)], 1.0)
        return info


class VLLMRequestMetrics:
    """The per-request families, observed as each request finishes (and `observe_token_gap`
    between streamed chunks)."""

    def __init__(self, reg: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        tokens = token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds.", TOKEN_TIME_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.", TOKEN_TIME_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", REQUEST_TIME_BUCKETS)
        self.phases = {phase: histogram(f"vllm:request_{phase}_time_seconds", f"Histogram of "
                                        f"time spent in {what} phase for request.",
                                        REQUEST_TIME_BUCKETS)
                       for phase, what in (("queue", "WAITING"), ("inference", "RUNNING"),
                                           ("prefill", "PREFILL"), ("decode", "DECODE"))}
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill "
                                        "tokens processed.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens", "Number of "
                                            "generation tokens processed.", tokens)
        self.max_generation = histogram("vllm:request_max_num_generation_tokens", "Histogram "
                                        "of the most tokens any sample of a request "
                                        "generated.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request "
                                  "parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the "
                                           "max_tokens request parameter.", tokens)
        self.preemptions = histogram("vllm:request_num_preemptions", "Histogram of the number "
                                     "of times a request was preempted.", PREEMPTION_BUCKETS)
        self.computed = histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new "
                                  "KV tokens computed during prefill (excluding cached "
                                  "tokens).", tokens)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.")
        self.cached_tokens = counter("vllm:prompt_tokens_cached", "Number of cached prompt "
                                     "tokens.")
        self.by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by "
                                 "source.", [*LABELS, "source"], registry=reg)
        self.success = Counter("vllm:request_success", "Count of successfully processed "
                               "requests.", [*LABELS, "finished_reason"], registry=reg)
        self.admission = Counter("vllm:admission_rejections", "Number of admission attempts "
                                 "rejected by a queue limit, by reason.",
                                 ["model_name", "reason"], registry=reg)
        m = (ENGINE, model_name)
        for reason in FINISHED_REASONS:
            self.success.labels(*m, reason)
        for source in ("local_compute", "local_cache_hit"):
            self.by_source.labels(*m, source)
        self.admission.labels(model_name, "max_num_queued_reqs")
        for family in (self.prompt_tokens, self.generation_tokens, self.cached_tokens,
                       self.ttft, self.itl, self.tpot, self.e2e, *self.phases.values(),
                       self.request_prompt, self.request_generation, self.max_generation,
                       self.params_n, self.params_max_tokens, self.preemptions, self.computed):
            family.labels(*m)  # every series from the start, as vLLM exports them

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(ENGINE, self.model_name).observe(seconds)

    def rejected(self) -> None:
        """One request refused because the worker's queue was full (kvserve's 429)."""
        self.admission.labels(self.model_name, "max_num_queued_reqs").inc()

    def observe_finished(self, output: RequestOutput, max_tokens: int | None) -> None:
        m = (ENGINE, self.model_name)
        prompt = len(output.prompt_token_ids)
        generated = output.num_generated_tokens
        cached = min(output.num_cached_tokens, prompt)
        first, end = output.first_token_time, output.finished_time
        scheduled = output.scheduled_time
        if first is not None:
            self.ttft.labels(*m).observe(first - output.arrival_time)
        if end is not None:
            self.e2e.labels(*m).observe(end - output.arrival_time)
        if scheduled is not None:
            self.phases["queue"].labels(*m).observe(scheduled - output.arrival_time)
            if end is not None:
                self.phases["inference"].labels(*m).observe(end - scheduled)
            if first is not None:
                self.phases["prefill"].labels(*m).observe(first - scheduled)
        if first is not None and end is not None:
            self.phases["decode"].labels(*m).observe(end - first)
            longest = max((len(c.token_ids) for c in output.outputs), default=0)
            if longest > 1:
                self.tpot.labels(*m).observe((end - first) / (longest - 1))
        self.request_prompt.labels(*m).observe(prompt)
        self.request_generation.labels(*m).observe(generated)
        self.max_generation.labels(*m).observe(max((len(c.token_ids) for c in output.outputs),
                                                   default=0))
        self.params_n.labels(*m).observe(len(output.outputs))
        if max_tokens is not None:
            self.params_max_tokens.labels(*m).observe(max_tokens)
        self.preemptions.labels(*m).observe(output.num_preemptions)
        self.computed.labels(*m).observe(prompt - cached)
        self.prompt_tokens.labels(*m).inc(prompt)
        self.generation_tokens.labels(*m).inc(generated)
        self.cached_tokens.labels(*m).inc(cached)
        self.by_source.labels(*m, "local_compute").inc(prompt - cached)
        self.by_source.labels(*m, "local_cache_hit").inc(cached)
        for completion in output.outputs:
            reason = completion.finish_reason or FinishReason.ABORT
            self.success.labels(*m, reason.openai_name).inc()
