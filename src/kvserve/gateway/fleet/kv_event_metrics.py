"""What the KV-event subscriber (`zmq_events.py`) counts per worker, and the Prometheus series
the gateway and `kvserve epp` export from it: how far each worker's index can be trusted is
otherwise visible only in the log."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ReplayOutcome(enum.Enum):
    """How a replay request ended: every batch from the asked seq on (`complete`), some missing
    (`partial`: the publisher's buffer rolled over, or a batch was malformed), or no answer
    within the timeout (`timeout`)."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    TIMEOUT = "timeout"


class ResyncReason(enum.Enum):
    """Why a worker's index was relearned: the subscriber joined after the worker started
    publishing (`join`, also when it first attaches), the publisher restarted (`restart`), or
    batches were lost (`gap`)."""

    JOIN = "join"
    RESTART = "restart"
    GAP = "gap"


@dataclass(slots=True)
class WorkerEventStats:
    """One worker's counters since the gateway began following it (all ranks together)."""

    events: Counter[str] = field(default_factory=Counter)  # stored / removed / cleared
    gaps: int = 0
    malformed: int = 0
    replays: Counter[ReplayOutcome] = field(default_factory=Counter)
    resyncs: Counter[ResyncReason] = field(default_factory=Counter)


class EventStatsSource(Protocol):
    """What the collector reads: the followed workers' stats, whether each one's index is
    synced, and the workers that publish nothing (their index is unknown for good)."""

    stats: dict[str, WorkerEventStats]
    silent: set[str]

    def is_synced(self, url: str) -> bool: ...


class KvEventCollector(Collector):
    """The subscriber's series, read at scrape time; a worker's go when it leaves the fleet."""

    def __init__(self, source: EventStatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        events = CounterMetricFamily("kvserve:gateway_kv_events", "KV events applied to the "
                                     "worker's index, live or replayed, by type (stored, "
                                     "removed, cleared).", labels=["worker", "type"])
        gaps = CounterMetricFamily("kvserve:gateway_kv_event_gaps", "Live KV-event batches "
                                   "that came after a missing sequence number (lost ones).",
                                   labels=["worker"])
        malformed = CounterMetricFamily("kvserve:gateway_kv_event_malformed", "KV-event "
                                        "messages that could not be decoded (skipped).",
                                        labels=["worker"])
        replays = CounterMetricFamily("kvserve:gateway_kv_event_replays", "Replays asked of "
                                      "the worker's replay endpoint, by outcome (complete, "
                                      "partial, timeout).", labels=["worker", "outcome"])
        resyncs = CounterMetricFamily("kvserve:gateway_kv_event_resyncs", "Times the worker's "
                                      "index was relearned, by reason (join: the gateway came "
                                      "after the worker; restart: the publisher restarted; "
                                      "gap: batches were lost).", labels=["worker", "reason"])
        synced = GaugeMetricFamily("kvserve:gateway_kv_index_synced", "1 while the worker's "
                                   "KV-event index follows its cache from a known state; 0 "
                                   "while unknown (resynchronising, or the worker publishes no "
                                   "events to this gateway).", labels=["worker"])
        for url, stats in list(self.source.stats.items()):
            for kind in ("stored", "removed", "cleared"):
                events.add_metric([url, kind], stats.events[kind])
            gaps.add_metric([url], stats.gaps)
            malformed.add_metric([url], stats.malformed)
            for outcome in ReplayOutcome:
                replays.add_metric([url, outcome.value], stats.replays[outcome])
            for reason in ResyncReason:
                resyncs.add_metric([url, reason.value], stats.resyncs[reason])
            synced.add_metric([url], 1.0 if self.source.is_synced(url) else 0.0)
        for url in sorted(self.source.silent):
            synced.add_metric([url], 0.0)
        yield from (events, gaps, malformed, replays, resyncs, synced)
