"""LoRA metrics as the ecosystem reads them, and kvserve's adapter counters.

`vllm:lora_requests_info` is vLLM's: a gauge whose value is the time (Unix seconds) its label
set was last seen, labelled `max_lora`, `running_lora_adapters` and `waiting_lora_adapters`
(comma-separated adapter names). Like vLLM's, a label set seen before stays exported with the
time it was last current, so readers (the Gateway API Inference Extension's `lora-affinity`
scorer) take the series with the largest value; kvserve keeps the last `KEPT_LABEL_SETS`.
The `kvserve:lora_*` counters are labelled by adapter name, bounded by the registry's label
cap (kvserve.runtime.lora_registry.MAX_LABELLED_ADAPTERS; past it: "other").
`kvserve:lora_requests_waiting_for_slot` (no labels) counts the waiting requests the last step
left for want of an adapter slot (`--max-loras`): with a high load rate, adapter thrashing
(docs/operations.md), which a prefix-cache hit rate cannot show.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.runtime import AsyncEngine

KEPT_LABEL_SETS = 32


class LoRACollector:
    """Collected at scrape time from the engine's snapshot and its LoRA registry."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._seen: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        registry = self.engine.lora
        if registry is None:
            return
        stats = self.engine.stats
        key = (str(self.engine.info.args.max_loras), ",".join(stats.running_loras),
               ",".join(stats.waiting_loras))
        self._seen[key] = time.time()
        self._seen.move_to_end(key)
        while len(self._seen) > KEPT_LABEL_SETS:
            self._seen.popitem(last=False)
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters"])
        for labels, seen_at in self._seen.items():
            info.add_metric(list(labels), seen_at)
        yield info
        waiting = GaugeMetricFamily(
            "kvserve:lora_requests_waiting_for_slot", "Waiting requests the last step left for "
            "want of a LoRA adapter slot (--max-loras distinct adapters a step).")
        waiting.add_metric([], stats.num_waiting_for_adapter)
        yield waiting
        for name, doc, counts in (
                ("kvserve:lora_adapter_loads", "LoRA adapters copied into a device slot.",
                 registry.loads),
                ("kvserve:lora_adapter_evictions", "LoRA adapters evicted from a device slot "
                 "(least recently used, to load another).", registry.evictions),
                ("kvserve:lora_adapter_host_evictions", "LoRA adapters evicted from host "
                 "memory (past --max-cpu-loras; read again from disk when next needed).",
                 registry.host_evictions),
                ("kvserve:lora_rows", "Tokens computed under each LoRA adapter.", registry.rows)):
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for label, value in sorted(dict(counts).items()):
                family.add_metric([label], value)
            yield family
