"""The gateway's view of its workers: health, in-flight counts, scraped load, ejection, and
workers that come and go.

A worker is ejected after consecutive connection failures and comes back after a backoff that
doubles each time (capped); a 429/503 from a worker is backpressure, never a failure, so a busy
worker is never ejected for being busy. A worker removed from the fleet (`remove`, from
discovery) drains: it takes no new request, and is forgotten once its last one ends
(`end_request`), so a request in flight on a leaving worker finishes normally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.gateway.core.adapters import AdapterState
from kvserve.gateway.core.pipeline import WorkerView


@dataclass(slots=True)
class WorkerState:
    """Everything the gateway knows about one worker (mutated on the event loop only)."""

    url: str
    role: str = "both"  # "prefill" / "decode" in disaggregated mode
    healthy: bool = True
    in_flight: int = 0
    dispatched: int = 0  # requests ever sent to it, counted as sent (in_flight's increments)
    abandoned: int = 0  # requests closed before their answer ended (client gone, deadline)
    foreign: int = 0  # requests it served that this gateway did not send, last scrape
    prefill_backlog_tokens: int = 0  # see WorkerView; kept by forward.Forwarder
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int = 0  # from the worker's /metrics; 0 until known
    batch_capacity: int = 0  # requests it runs at once, seen when it queued some; 0 until then
    capacity_declared: bool = False  # the worker says its batch (kvserve:max_num_seqs)
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    requests_finished: float | None = None  # its finished-requests counter; None: not exported
    adapters: AdapterState | None = None  # its LoRA adapters (vllm:lora_requests_info)
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    backoff_s: float = 0.0
    requests: int = 0
    failures: int = 0
    backpressure: int = 0
    last_error: str | None = None
    last_scrape: float = 0.0
    draining: bool = False  # left the fleet: no new requests; forgotten when in_flight is 0

    def takes_traffic(self, now: float) -> bool:
        """Whether a new request may go here: healthy, not ejected, not draining."""
        return self.healthy and now >= self.ejected_until and not self.draining

    def view(self, now: float) -> WorkerView:
        return WorkerView(
            worker_id=self.url,
            healthy=self.healthy and now >= self.ejected_until,
            in_flight=self.in_flight,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            prefill_backlog_tokens=self.prefill_backlog_tokens,
            adapters=self.adapters,
        )


def worker_slots(batch_capacity: int) -> int:
    """Requests kept on a worker that runs `batch_capacity` at once (0: unknown): its batch
    plus a quarter again waiting, so a finished request is replaced at once without a queue
    long enough to matter. 0 when the capacity is unknown."""
    return batch_capacity + max(2, batch_capacity // 4) if batch_capacity > 0 else 0


@dataclass(slots=True)
class WorkerPool:
    """All workers, with the ejection policy. `urls` may be empty only with `allow_empty`
    (workers discovered later). `on_added(url)` runs for each worker added, `on_forgotten(url)`
    for each one forgotten (removed and drained): what else keeps state per worker (policy
    indexes, metric series, event followers) follows the fleet through them."""

    urls: list[str]
    eject_after_failures: int = 3
    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    allow_empty: bool = False
    workers: dict[str, WorkerState] = field(init=False)
    on_added: list[Callable[[str], None]] = field(default_factory=list)
    on_forgotten: list[Callable[[str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.urls and not self.allow_empty:
            raise ValueError("the gateway needs at least one --worker URL")
        self.workers = {}
        for url in self.urls:
            self.workers.setdefault(url.rstrip("/"), WorkerState(url.rstrip("/")))

    def views(self, now: float) -> list[WorkerView]:
        """What the policies choose from: every worker but the draining ones."""
        return [w.view(now) for w in self.workers.values() if not w.draining]

    def active_urls(self) -> set[str]:
        """The fleet as discovered: every worker not draining."""
        return {url for url, w in self.workers.items() if not w.draining}

    def add(self, url: str) -> bool:
        """Put a worker in the fleet (a draining one takes traffic again); True when it is
        new to the pool. Its load is unknown until scraped; it takes traffic at once."""
        url = url.rstrip("/")
        worker = self.workers.get(url)
        if worker is not None:
            worker.draining = False
            return False
        self.workers[url] = WorkerState(url)
        for callback in self.on_added:
            callback(url)
        return True

    def remove(self, url: str) -> None:
        """Take a worker out of the fleet: it gets no new request, and is forgotten once its
        in-flight ones end (at once when it has none). An unknown URL is ignored."""
        worker = self.workers.get(url.rstrip("/"))
        if worker is None:
            return
        worker.draining = True
        self._forget_if_drained(worker)

    def end_request(self, worker: WorkerState) -> None:
        """One request the gateway had open on `worker` ended (whatever way): its in-flight
        count drops, and a draining worker left with none is forgotten."""
        worker.in_flight -= 1
        self._forget_if_drained(worker)

    def _forget_if_drained(self, worker: WorkerState) -> None:
        if worker.draining and worker.in_flight <= 0 and self.workers.get(worker.url) is worker:
            del self.workers[worker.url]
            for callback in self.on_forgotten:
                callback(worker.url)

    def fleet_slots(self, now: float) -> int | None:
        """Requests the healthy workers can hold without a queue of their own beyond a little
        headroom (`worker_slots`); None while some healthy worker's capacity is unknown (it
        has neither declared it nor been seen full yet), or when none is healthy (the router
        answers that)."""
        slots = [worker_slots(w.batch_capacity) for w in self.serving(now)]
        if not slots or 0 in slots:
            return None
        return sum(slots)

    def all_declared(self, now: float) -> bool:
        """Whether every healthy worker declares its batch (kvserve workers do); False when
        none is healthy."""
        serving = self.serving(now)
        return bool(serving) and all(w.capacity_declared for w in serving)

    def serving(self, now: float) -> list[WorkerState]:
        """The workers that take traffic now: healthy and not ejected."""
        return [w for w in self.workers.values() if w.takes_traffic(now)]

    def get(self, url: str) -> WorkerState:
        return self.workers[url]

    def record_success(self, url: str) -> None:
        # A worker forgotten while the answer was on its way has nothing left to record.
        worker = self.workers.get(url)
        if worker is None:
            return
        worker.consecutive_failures = 0
        worker.backoff_s = 0.0
        worker.healthy = True

    def record_backpressure(self, url: str) -> None:
        worker = self.workers.get(url)
        if worker is not None:
            worker.backpressure += 1

    def record_failure(self, url: str, error: str, now: float) -> None:
        """A connection-level failure; enough in a row eject the worker for a backoff."""
        worker = self.workers.get(url)
        if worker is None:
            return
        worker.failures += 1
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.consecutive_failures >= self.eject_after_failures:
            self._eject(worker, now)

    def record_health(self, url: str, ok: bool, now: float, error: str | None = None) -> None:
        """An active health check result: a failed check ejects at once (backoff doubling while
        it keeps failing); a passing one is strong evidence, so the worker is readmitted within
        one base backoff and its backoff resets (a restarted worker is back in seconds)."""
        worker = self.workers.get(url)
        if worker is None:
            return
        if ok:
            worker.healthy = True
            worker.ejected_until = min(worker.ejected_until, now + self.base_backoff_s)
            worker.backoff_s = 0.0
            worker.consecutive_failures = 0
        else:
            worker.last_error = error
            self._eject(worker, now)

    def _eject(self, worker: WorkerState, now: float) -> None:
        worker.healthy = False
        worker.backoff_s = min(self.max_backoff_s, max(self.base_backoff_s, worker.backoff_s * 2))
        worker.ejected_until = now + worker.backoff_s
