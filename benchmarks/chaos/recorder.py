"""What the harness records, continuously, every `interval_s`: per process RSS, open fds and
threads (/proc); per worker the free and held blocks, the audit and the ledger (/debug/kv); and
every target's samples of the series the alert rules in deploy/prometheus read (/metrics), kept
per scrape for promtool (`alerts.py`). All rows go to JSONL files as they are taken."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.chaos.fleet import Fleet, debug_kv, gateway_url
from benchmarks.chaos.procs import proc_stats

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def rule_names() -> set[str]:
    """Every identifier in alerts.yml's expressions that could be a metric name."""
    import yaml  # type: ignore[import-untyped]

    groups = yaml.safe_load(RULES.read_text())["groups"]
    exprs = " ".join(r["expr"] for g in groups for r in g["rules"])
    return set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+|vllm:[a-zA-Z0-9_:]+|\bup\b",
                          exprs))


def _base(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class Recorder:
    def __init__(self, fleet: Fleet, out: Path, interval_s: float) -> None:
        self.fleet, self.out, self.interval_s = fleet, out, interval_s
        self.timeout_s = min(2.0, interval_s / 2)
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="recorder")
        self.names = rule_names()
        self.bases = {_base(n) for n in self.names}
        # target -> (job, [per-scrape {series key: value}])
        self.series: dict[str, tuple[str, list[dict[str, float]]]] = {}
        self.times: list[float] = []
        self.proc_rows: list[dict[str, Any]] = []
        self.kv_rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="recorder")
        self._files = {k: (out / f"{k}.jsonl").open("a", encoding="utf-8")
                       for k in ("procs", "kv", "gateways")}

    def targets(self) -> list[tuple[str, str, str]]:
        """(name, job, base URL) of everything scraped."""
        out = [(f"worker{i}", "kvserve-worker", w.url) for i, w in enumerate(self.fleet.workers)]
        out += [(g.name, "kvserve-gateway", gateway_url(g)) for g in self.fleet.gateways]
        if self.fleet.epp is not None:
            out.append(("epp", "kvserve-epp", str(self.fleet.epp.probe).rsplit("/", 1)[0]))
        return out

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for f in self._files.values():
            f.close()
        self.save()

    def save(self) -> None:
        """The alert series and scrape times as series.json (read back by the report)."""
        path = self.out / "series.json"
        path.write_text(json.dumps({"times": self.times, "series": self.series}))

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            if len(self.times) % 60 == 0:
                self.save()  # a run cut short still leaves its series
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def sample(self) -> None:
        """One recording; every read at once, each bounded (a hung worker costs one timeout,
        not one per read)."""
        now = time.time()
        self.times.append(now)
        targets = self.targets()
        scrapes = [self._pool.submit(self._scrape, n, j, u) for n, j, u in targets]
        debugs = [self._pool.submit(debug_kv, w, self.timeout_s) if w.proc.alive() else None
                  for w in self.fleet.workers]
        listings = [self._pool.submit(_workers, gateway_url(g), self.timeout_s)
                    for g in self.fleet.gateways]
        for (name, job, _), future in zip(targets, scrapes, strict=True):
            self.series.setdefault(name, (job, []))[1].append(future.result())
        for proc in self.fleet.procs():
            stats = proc_stats(proc.pid) if proc.pid is not None else None
            row = {"t": now, "proc": proc.name, "alive": stats is not None, **(stats or {})}
            self.proc_rows.append(row)
            self._files["procs"].write(json.dumps(row) + "\n")
        for i, debug in enumerate(debugs):
            row = {"t": now, "worker": f"worker{i}",
                   **kv_summary(debug.result() if debug is not None else None)}
            self.kv_rows.append(row)
            self._files["kv"].write(json.dumps(row) + "\n")
        for gateway, listing in zip(self.fleet.gateways, listings, strict=True):
            row = {"t": now, "gateway": gateway.name, "workers": listing.result()}
            self._files["gateways"].write(json.dumps(row) + "\n")
        for f in self._files.values():
            f.flush()

    def _scrape(self, name: str, job: str, url: str) -> dict[str, float]:
        target = {"job": job, "instance": name}
        up_key = _key("up", {}, target)
        try:
            response = httpx.get(f"{url}/metrics", timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError:
            return {up_key: 0.0}
        samples = {up_key: 1.0}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                if s.name in self.names or _base(s.name) in self.bases:
                    samples[_key(s.name, s.labels, target)] = float(s.value)
        return samples


def _key(name: str, labels: dict[str, str], target: dict[str, str]) -> str:
    merged = {**labels, **target}
    body = ",".join(f'{k}="{v}"' for k, v in sorted(merged.items()))
    return f"{name}{{{body}}}"


def kv_summary(debug: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one /debug/kv read (None: the worker did not answer)."""
    if debug is None:
        return {"answered": False}
    audit, census = debug["audit"], debug["audit"]["census"]
    return {"answered": True, "audit_ok": audit["ok"],
            "violations": [v["kind"] for v in audit["violations"]][:5],
            "held": census["held"], "free": census["free_cached"] + census["free_uncached"],
            "num_blocks": census["num_blocks"], "live_requests": debug["num_live_requests"],
            "ledger": len(debug["held_blocks_by_request"])}


def _workers(url: str, timeout_s: float) -> list[dict[str, Any]] | None:
    """A gateway's view of each worker (/workers): healthy, ejected for, last error, events."""
    try:
        listing = httpx.get(f"{url}/workers", timeout=timeout_s).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return [{k: w.get(k) for k in ("url", "healthy", "ejected_for_s", "last_error", "requests",
                                   "failures", "kv_events")} for w in listing]
