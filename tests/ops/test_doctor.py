"""`kvserve doctor` against live servers: a healthy fleet passes, a worker with a planted leak
is named with the requests holding its blocks, and round-robin traffic over small caches is
named as thrashing."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from kvserve.cli import main as kvserve_main
from tests.ops.conftest import Servers
from tests.ops.processes import ADMIN_KEY, wait_until

NUM_TENANTS = 6
PREFIX_LEN = 192  # 12 blocks of 16: six tenants need 72 blocks, a worker has 48


def run_doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kvserve doctor ARGS` in this process (the CLI's own entry point, without paying for a
    second interpreter and torch import); returns the exit status and stdout."""
    capsys.readouterr()
    code = kvserve_main(["doctor", *args, "--admin-key", ADMIN_KEY])
    return code, capsys.readouterr().out


def report_of(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code, out = run_doctor(capsys, *args, "--json")
    return code, json.loads(out)


def findings(report: dict[str, Any], problem: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["problem"] == problem]


def test_healthy_fleet_exits_zero(servers: Servers,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, report = report_of(capsys, servers.gateway.url, "--interval", "1")
    assert code == 0, report
    assert report["ok"] and not [f for f in report["findings"] if f["severity"] != "info"]
    kinds = {t["url"]: t["kind"] for t in report["targets"]}
    # the gateway was told apart from the worker, and its worker was followed
    assert kinds == {servers.gateway.url: "gateway", servers.worker.url: "kvserve worker"}


def _abandon_streams(url: str, count: int) -> None:
    """Start streaming completions and hang up after two chunks: the server aborts each one."""
    for i in range(count):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30.0,
                          headers={"X-Request-Id": f"leak-{i}"},
                          json={"prompt": list(range(5, 45 + i)), "max_tokens": 200,
                                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data:")
                if chunks >= 2:
                    break


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_planted_leak_is_named_with_its_requests(servers: Servers,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    url = servers.leaky.url
    _abandon_streams(url, 3)
    wait_until(lambda: _gauge(url, "kvserve:kv_live_requests") == 3
               and _gauge(url, "vllm:num_requests_running") == 0, 20.0,
               "three aborted requests left in the ledger")

    code, report = report_of(capsys, url, "--interval", "1")
    assert code == 2
    (leak,) = [f for f in findings(report, "leak") if f["severity"] == "critical"]
    leaked = leak["request_ids"]
    assert sorted(r.rsplit("-", 2)[0] for r in leaked) == ["leak-0", "leak-1", "leak-2"]
    assert any("idle worker holds 0" in e for e in leak["evidence"])
    assert findings(report, "audit")  # the doctor's own audit fails too

    code, text = run_doctor(capsys, url, "--interval", "0")  # people see the same
    assert code == 2
    assert "leak" in text and all(r in text for r in leaked)


def _send_round_robin(url: str, start: int, stop: threading.Event | None,
                      count: int | None = None) -> None:
    """Each tenant twice in a row, so round robin gives both workers every tenant."""
    prefixes = [[4 + (t * 37 + j) % 290 for j in range(PREFIX_LEN)]
                for t in range(NUM_TENANTS)]
    i = start
    with httpx.Client(timeout=60.0) as client:
        while (stop is None or not stop.is_set()) and (count is None or i < start + count):
            tenant = (i // 2) % NUM_TENANTS
            response = client.post(f"{url}/v1/completions",
                                   headers={"X-Tenant-Id": f"tenant-{tenant}"},
                                   json={"prompt": prefixes[tenant] + [5 + i % 200] * 16,
                                         "max_tokens": 1})
            assert response.status_code == 200, response.text
            i += 1


def test_round_robin_over_small_caches_is_named_thrashing(
        servers: Servers, capsys: pytest.CaptureFixture[str]) -> None:
    gateway = servers.round_robin.url
    _send_round_robin(gateway, 0, None, count=4 * NUM_TENANTS)  # every tenant twice per worker
    stop = threading.Event()
    background = threading.Thread(target=_send_round_robin, args=(gateway, 1000, stop))
    background.start()
    try:
        code, report = report_of(capsys, gateway, "--interval", "2")
    finally:
        stop.set()
        background.join(30.0)
    assert code >= 1
    on_gateway = [f for f in findings(report, "thrashing") if f["target"] == gateway]
    assert on_gateway, report
    evidence = " ".join(on_gateway[0]["evidence"])
    assert "round_robin" in evidence and f"of {NUM_TENANTS} tenants" in evidence
    on_workers = {f["target"] for f in findings(report, "thrashing")} - {gateway}
    assert on_workers & {w.url for w in servers.small_workers}, report
