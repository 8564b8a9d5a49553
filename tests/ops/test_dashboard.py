"""The Grafana dashboard imports (valid JSON, a Prometheus datasource variable, a query in every
panel), every metric it or the alert rules read is one that a live worker or gateway exports,
checked against their real /metrics, and it works on a fleet of plain vLLM workers (checked
against vLLM 0.32's recorded /metrics): what needs kvserve workers says so in its title."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from kvserve.gateway.fleet.build import build_fleet
from kvserve.gateway.fleet.settings import GatewaySettings
from tests.ops.conftest import Servers
from tests.ops.promql import exported_names, metric_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvserve.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE"}  # made by Prometheus, not by a target
# A live `kvserve serve --tensor-parallel-size 2`'s /metrics (the collective series are only
# there): recorded by tests/ops/test_live_faults.py, which checks the same panels live.
TP_METRICS = Path(__file__).resolve().parents[1] / "data" / "tp_metrics" / "worker_tp2.prom"
VLLM_METRICS = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics" / "burst.prom"
KVSERVE_ONLY = "(kvserve workers only)"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # collapsed rows keep theirs inside
    return [p for p in found if p["type"] != "row"]


def dashboard_queries(board: dict[str, Any]) -> dict[str, set[str]]:
    """Where each query lives ("panel title / refId" or "variable name") -> its metric names."""
    queries = {}
    for panel in panels(board):
        for target in panel["targets"]:
            queries[f"{panel['title']} / {target['refId']}"] = metric_names(target["expr"])
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\(([\w:]+)\s*,\s*\w+\)", query.strip())
            assert match, f"variable {var['name']}: unexpected query {query!r}"
            queries[f"variable {var['name']}"] = {match.group(1)}
    return queries


def test_dashboard_is_importable() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()


def test_dashboard_covers_the_issue() -> None:
    used = set().union(*dashboard_queries(dashboard()).values())
    for name in ("vllm:kv_cache_usage_perc", "kvserve:kv_free_blocks", "kvserve:kv_held_blocks",
                 "kvserve:kv_cached_free_blocks", "kvserve:kv_allocated_blocks_total",
                 "kvserve:kv_freed_blocks_total", "kvserve:kv_evicted_blocks_total",
                 "vllm:prefix_cache_hits_total", "kvserve:tenant_prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_waiting",
                 "kvserve:kv_corruption_detections_total", "kvserve:kv_reclaimed_blocks_total",
                 "kvserve:kv_audit_failures_total", "kvserve:gateway_requests_total",
                 "kvserve:gateway_retries_total", "kvserve:gateway_rejections_total",
                 "kvserve:gateway_added_latency_seconds_bucket",
                 "kvserve:collective_duration_seconds_bucket",
                 "kvserve:collective_duration_seconds_count", "kvserve:collective_errors_total",
                 "kvserve:collective_rank_skew_seconds_bucket", "kvserve:collective_slowest_rank",
                 "kvserve:tp_step_divergences_total", "kvserve:tensor_parallel_size"):
        assert name in used, f"the dashboard shows nothing of {name}"


@pytest.fixture(scope="module")
def exported(servers: Servers) -> set[str]:
    """Names on a live worker's and a live gateway's /metrics (one request went through), on a
    tensor-parallel worker's recorded one, and in a `precise` gateway's registry (its
    KV-event subscriber's families are only there)."""
    return exported_names(servers.worker.metrics_text()) | exported_names(
        servers.gateway.metrics_text()) | exported_names(TP_METRICS.read_text()) | (
        precise_gateway_names()) | lora_worker_names()


def lora_worker_names() -> set[str]:
    """What a worker started with --enable-lora adds (its collector, over an engine's
    published parts: the registry's counters, the stats snapshot, the limits)."""
    from collections import Counter
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from kvserve.server.lora_metrics import LoRACollector

    counts = Counter({"a0": 1})
    engine = SimpleNamespace(
        lora=SimpleNamespace(loads=counts, evictions=counts, host_evictions=counts, rows=counts),
        stats=SimpleNamespace(running_loras=("a0",), waiting_loras=(),
                              num_waiting_for_adapter=0),
        info=SimpleNamespace(args=SimpleNamespace(max_loras=2)))
    registry = CollectorRegistry()
    registry.register(LoRACollector(engine))  # type: ignore[arg-type]
    return exported_names(generate_latest(registry).decode())


def precise_gateway_names() -> set[str]:
    fleet = build_fleet(GatewaySettings(workers=("http://127.0.0.1:9",), policy="precise"))
    assert fleet.subscriber is not None
    try:
        return exported_names(generate_latest(fleet.metrics.registry).decode())
    finally:
        asyncio.run(fleet.subscriber.stop())


def test_dashboard_reads_only_exported_metrics(exported: set[str]) -> None:
    # the histograms were observed, so their series exist for real, not only by type
    assert "vllm:time_to_first_token_seconds_bucket" in exported
    assert "kvserve:gateway_added_latency_seconds_bucket" in exported
    unknown = {where: sorted(names - exported) for where, names in
               dashboard_queries(dashboard()).items() if names - exported}
    assert not unknown, f"queries name metrics nobody exports: {unknown}"


def test_alert_rules_read_only_exported_metrics(exported: set[str]) -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the alert rules")
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    unknown = {r.get("alert") or r["record"]: sorted(bad) for r in rules
               if (bad := metric_names(r["expr"]) - exported - recorded - PROMETHEUS_OWN)}
    assert not unknown, f"rules name metrics nobody exports: {unknown}"


def test_dashboard_works_on_a_vllm_only_fleet() -> None:
    """A worker panel works on vLLM workers when its first query reads only what vLLM exports;
    every other worker panel says in its title that it needs kvserve workers. Gateway panels
    read the gateway's own series, whatever it fronts."""
    vllm = exported_names(VLLM_METRICS.read_text())
    board = dashboard()
    for var in board["templating"]["list"]:
        if var["name"] == "instance":
            assert dashboard_queries(board)["variable instance"] <= vllm
    works, needs_kvserve = [], []
    for panel in panels(board):
        names = [metric_names(t["expr"]) for t in sorted(panel["targets"],
                                                         key=lambda t: t["refId"])]
        if all(n.startswith("kvserve:gateway_") for ns in names for n in ns):
            continue
        (works if names[0] <= vllm else needs_kvserve).append(panel["title"])
    assert not [t for t in works if KVSERVE_ONLY in t], "works on vLLM, yet says kvserve only"
    assert not [t for t in needs_kvserve if KVSERVE_ONLY not in t], \
        f"need kvserve metrics but do not say so: {needs_kvserve}"
    for title in ("KV usage while idle (leak signature)", "Queue depth", "KV cache usage",
                  "Prefix cache hit rate per worker", "Rejected requests (per second)",
                  "Request phases p90: queue, prefill, decode", "Requests waiting by reason"):
        assert title in works, title
