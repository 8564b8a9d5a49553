"""What the doctor reads from a live target: /metrics, /health and, by kind, /debug/kv (worker),
/v1/models (worker) or /workers (gateway), taken as snapshots some seconds apart.

Read-only: every request is a GET. A target that cannot be read yields a snapshot with `error`
set, never an exception, so one dead worker does not stop the diagnosis of the rest.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Kind(enum.StrEnum):
    """What a URL serves, told apart by the metric names on its /metrics."""

    KVSERVE_WORKER = "kvserve worker"
    VLLM_WORKER = "vllm-compatible worker"
    GATEWAY = "gateway"
    UNKNOWN = "unknown"

    @property
    def is_worker(self) -> bool:
        return self in (Kind.KVSERVE_WORKER, Kind.VLLM_WORKER)


@dataclass(frozen=True, slots=True)
class Metrics:
    """One parsed exposition: `families` maps a family name to its type; `samples` holds
    (sample name, labels, value). Lookups sum over the samples whose labels match."""

    families: dict[str, str]
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def from_text(cls, text: str) -> Metrics:
        families: dict[str, str] = {}
        samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            families[family.name] = family.type
            samples.extend((s.name, dict(s.labels), float(s.value)) for s in family.samples)
        return cls(families, tuple(samples))

    def has(self, name: str) -> bool:
        """Whether the exposition has `name`: a sample, or a family (a counter `x_total`
        whose labelled children do not exist yet is family `x`)."""
        return (any(n == name for n, _, _ in self.samples) or name in self.families
                or (name.endswith("_total") and name.removesuffix("_total") in self.families))

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of `name`'s samples matching `labels`; None when there is none."""
        values = [v for n, lab, v in self.samples
                  if n == name and all(lab.get(k) == want for k, want in labels.items())]
        return sum(values) if values else None

    def value(self, name: str, **labels: str) -> float:
        """Like `get`, but 0 when there is no such sample."""
        found = self.get(name, **labels)
        return 0.0 if found is None else found

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """`name`'s samples summed per value of `label`."""
        out: dict[str, float] = {}
        for n, lab, v in self.samples:
            if n == name and label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [lab for n, lab, _ in self.samples if n == name]

    def kind(self) -> Kind:
        names = set(self.families) | {n for n, _, _ in self.samples}
        if any(n.startswith("kvserve:gateway_") for n in names):
            return Kind.GATEWAY
        if "kvserve:kv_held_blocks" in names:
            return Kind.KVSERVE_WORKER
        if "vllm:num_requests_running" in names:
            return Kind.VLLM_WORKER
        return Kind.UNKNOWN


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything read from one target at (about) `taken_at`, a monotonic time in seconds.
    Missing parts are None; `error` says why the target could not be read at all."""

    url: str
    taken_at: float
    metrics: Metrics | None = None
    health_status: int | None = None
    health: dict[str, Any] | None = None
    debug_kv: dict[str, Any] | None = None
    debug_error: str | None = None
    models: dict[str, Any] | None = None
    workers: dict[str, Any] | None = None
    error: str | None = None

    @property
    def kind(self) -> Kind:
        return self.metrics.kind() if self.metrics is not None else Kind.UNKNOWN


@dataclass(frozen=True, slots=True)
class Observation:
    """Two snapshots of one target, `first` taken before `second`."""

    url: str
    first: Snapshot
    second: Snapshot

    @property
    def kind(self) -> Kind:
        kind = self.second.kind
        return kind if kind is not Kind.UNKNOWN else self.first.kind

    @property
    def interval_s(self) -> float:
        return max(self.second.taken_at - self.first.taken_at, 1e-9)


@dataclass(slots=True)
class Reader:
    """Reads targets over HTTP with `client`; `admin_key` for /debug/kv, `api_key` for /v1."""

    client: httpx.Client
    api_key: str | None = None
    admin_key: str | None = None
    clock: Callable[[], float] = field(default=time.monotonic)

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _json(self, url: str, key: str | None) -> tuple[dict[str, Any] | None, str | None]:
        try:
            response = self.client.get(url, headers=self._headers(key))
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return None, f"HTTP {response.status_code}"
        try:
            body = response.json()
        except ValueError:
            return None, "not JSON"
        return (body, None) if isinstance(body, dict) else (None, "not a JSON object")

    def kind_of(self, url: str) -> Kind:
        try:
            response = self.client.get(f"{url}/metrics")
            return Metrics.from_text(response.text).kind() if response.status_code == 200 \
                else Kind.UNKNOWN
        except (httpx.HTTPError, ValueError):
            return Kind.UNKNOWN

    def snapshot(self, url: str) -> Snapshot:
        """/metrics first, then the rest: /debug/kv runs an audit, which /metrics then shows."""
        taken_at = self.clock()
        try:
            response = self.client.get(f"{url}/metrics")
            response.raise_for_status()
            metrics = Metrics.from_text(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            return Snapshot(url, taken_at, error=f"/metrics: {type(exc).__name__}: {exc}")
        health_status, health = None, None
        try:
            answer = self.client.get(f"{url}/health")
            health_status = answer.status_code
            health = answer.json() if answer.headers.get("content-type", "").startswith(
                "application/json") else None
        except (httpx.HTTPError, ValueError):
            pass
        kind = metrics.kind()
        debug_kv = debug_error = models = workers = None
        if kind is Kind.KVSERVE_WORKER:
            debug_kv, debug_error = self._json(f"{url}/debug/kv", self.admin_key)
        if kind.is_worker:
            models, _ = self._json(f"{url}/v1/models", self.api_key)
        if kind is Kind.GATEWAY:
            workers, _ = self._json(f"{url}/workers", None)
        return Snapshot(url, taken_at, metrics, health_status, health, debug_kv, debug_error,
                        models, workers)

    def gateway_workers(self, url: str) -> list[str]:
        """The worker URLs a gateway routes to, as its /workers lists them."""
        body, _ = self._json(f"{url}/workers", None)
        if body is None:
            return []
        return [str(w["url"]).rstrip("/") for w in body.get("workers", []) if "url" in w]


def discover(reader: Reader, urls: Iterable[str], follow: bool) -> list[str]:
    """The targets: `urls` (normalised, in order), plus each gateway's workers when `follow`."""
    targets: list[str] = []
    for url in (u.rstrip("/") for u in urls):
        if url not in targets:
            targets.append(url)
        if follow and reader.kind_of(url) is Kind.GATEWAY:
            targets.extend(w for w in reader.gateway_workers(url) if w not in targets)
    return targets


def observe(reader: Reader, targets: Sequence[str], interval_s: float,
            sleep: Callable[[float], None] = time.sleep) -> list[Observation]:
    """Snapshot every target, wait `interval_s`, snapshot them all again."""
    firsts = [reader.snapshot(url) for url in targets]
    sleep(interval_s)
    seconds = [reader.snapshot(url) for url in targets]
    return [Observation(url, a, b) for url, a, b in zip(targets, firsts, seconds, strict=True)]
