"""Faults planted in live workers (tensor-parallel and single-rank), each named by `kvserve doctor`
run as its own process and by the alert rules (promtool on the series recorded while the fault
ran), and none mistaken for another:

- a slow rank (rank 1 sleeps before each forward pass for a range of steps): the doctor names a
  slow all_reduce and the slow rank, and rules the cache out; KVServeAllReduceSlow fires alone;
- a leak (tests/ops/leaky_worker.py, on the same TP worker once the slow steps are over, and on a
  single-rank worker): the doctor names the leak and its requests and rules the collectives out;
  only the leak alerts fire;
- a lost rank (rank 1 exits): the request ends within the watchdog's bound with a 503 naming the
  rank; the doctor names the failed collective and rules out corruption and leaks;
  KVServeCollectiveErrors fires, then (the worker gone) the scrape-down alert;
- a corruption (a block reassigned under a live request, KVSERVE_KV_FAULT): the request ends
  with a 500 (streamed, on the single rank: an error event) naming the block and both epochs,
  the corruption counter rises, the next requests are served; the doctor names corruption and,
  on the TP worker, states that the collectives are healthy; only KVServeCacheCorruption fires.

After each, no request hangs (every one ends within a bound) and no block is held but the
leaked ones (or the worker is reported dead and its processes are gone). The servers start
together, once for the module. With KVSERVE_RECORD_FAULT_SERIES=1 the recorded series replace
tests/data/fault_series/*.json (which test_fault_alerts.py checks without a live server), and
the TP worker's scrape tests/data/tp_metrics/worker_tp2.prom (test_dashboard.py's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config
from tests.ops.fault_expectations import EXPECTED
from tests.ops.fault_series import RECORD_VAR, UP, Recording, check_alerts
from tests.ops.processes import ADMIN_KEY, TINY_WORKER, Server, wait_until
from tests.ops.promql import exported_names
from tests.ops.test_dashboard import TP_METRICS, dashboard, dashboard_queries

SLOW_STEPS = (2, 90)  # rank 1 sleeps before each of these steps' forward pass
SLOW_S = 0.1
TP = ("--tensor-parallel-size", "2")
FLAGS = ("--num-kv-blocks", "64", "--idle-audit-interval-s", "0")
REQUEST_BOUND_S = 30.0  # no request may take longer, whatever the fault
HOOKS = {"KVSERVE_TEST_HOOKS": "1"}
CORRUPT = {**HOOKS, "KVSERVE_KV_FAULT": "reassign:3"}  # before the 3rd step with a live request
START_TIMEOUT_S = 300.0  # eight processes load torch at once on two cores


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    root = tmp_path_factory.mktemp("live-faults")
    model = write_random_checkpoint(root / "tiny-llama", base_config(), seed=0)
    argv = ["--model", str(model), *TINY_WORKER, *FLAGS]
    first, last = SLOW_STEPS
    plan = {
        "tp_slow_leak": ("tests.ops.leaky_worker", [*argv, *TP, "--collective-timeout", "30"],
                         {**HOOKS, "KVSERVE_TP_FAULT": f"1:{first}-{last}:delay:{SLOW_S}"}),
        "tp_killed": ("kvserve.cli", ["serve", *argv, *TP, "--collective-timeout", "3"],
                      {**HOOKS, "KVSERVE_TP_FAULT": "1:3:exit"}),
        "tp_corruption": ("kvserve.cli", ["serve", *argv, *TP], CORRUPT),
        "corruption": ("kvserve.cli", ["serve", *argv], CORRUPT),
        "leak": ("tests.ops.leaky_worker", argv, {}),
    }
    servers = {name: Server(name, module, args, root, env)
               for name, (module, args, env) in plan.items()}
    try:
        for server in servers.values():
            server.wait_ready(lambda r: r.status_code == 200, START_TIMEOUT_S)
        yield servers
    finally:
        for server in servers.values():
            server.interrupt()
        for server in servers.values():
            server.stop()


def doctor(url: str, interval_s: float) -> subprocess.Popen[str]:
    """`kvserve doctor URL --json` as its own process (started now, read with `report`)."""
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", "doctor", url, "--json",
                             "--interval", str(interval_s), "--admin-key", ADMIN_KEY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
    out, err = proc.communicate(timeout=60)
    assert out.strip(), err
    return proc.returncode, json.loads(out)


def problems(rep: dict[str, Any]) -> dict[str, str]:
    """problem -> severity of every finding above info."""
    return {f["problem"]: f["severity"] for f in rep["findings"] if f["severity"] != "info"}


def differential(rep: dict[str, Any]) -> dict[str, str]:
    (diff,) = [f for f in rep["findings"] if f["title"].startswith("differential diagnosis")]
    # "collectives: not tensor-parallel" on one rank
    return {line.split(":", 1)[0].removesuffix("s"): line for line in diff["evidence"]}


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0,
                         timeout=REQUEST_BOUND_S)


def complete(server: Server, seed: int, max_tokens: int) -> str:
    began = time.monotonic()
    try:
        out = client(server).completions.create(
            model=client(server).models.list().data[0].id, max_tokens=max_tokens,
            prompt=[5 + (seed * 7 + i) % 280 for i in range(10)], temperature=0,
            extra_body={"ignore_eos": True})
        return out.choices[0].finish_reason
    finally:
        assert time.monotonic() - began < REQUEST_BOUND_S


def gauge(server: Server, name: str) -> float:
    for line in server.metrics_text().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def finish(name: str, recording: Recording, tmp_path: Path) -> None:
    """promtool on the live series; with KVSERVE_RECORD_FAULT_SERIES=1 they become the test
    data."""
    if os.environ.get(RECORD_VAR) == "1":
        recording.save(name)
    check_alerts(recording, EXPECTED[name](recording), tmp_path)


def abandon_streams(url: str, count: int) -> None:
    """Streams hung up after two chunks: the leaky worker does not free aborted requests."""
    for i in range(count):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=REQUEST_BOUND_S,
                          headers={"X-Request-Id": f"leak-{i}"},
                          json={"prompt": list(range(5, 25 + i)), "max_tokens": 200,
                                "ignore_eos": True, "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data:")
                if chunks >= 2:
                    break


def check_leak(server: Server, name: str, tmp_path: Path, tensor_parallel: bool) -> None:
    recording = Recording()
    recording.scrape(server.url)
    abandon_streams(server.url, 3)
    wait_until(lambda: gauge(server, "kvserve:kv_live_requests") == 3
               and gauge(server, "vllm:num_requests_running") == 0, 20.0,
               "three aborted requests left in the ledger")
    for _ in range(14):  # the leak persists while the worker idles
        recording.scrape(server.url)
        time.sleep(0.05)
    code, rep = report(doctor(server.url, 1))
    assert code == 2, rep
    assert problems(rep).get("leak") == "critical", rep
    assert "collective" not in problems(rep) and "corruption" not in problems(rep), rep
    (leak,) = [f for f in rep["findings"] if f["problem"] == "leak"
               and f["severity"] == "critical"]
    assert sorted(r.rsplit("-", 2)[0] for r in leak["request_ids"]) == ["leak-0", "leak-1",
                                                                         "leak-2"]
    lines = differential(rep)
    assert lines["leak"].startswith("leak: THE CAUSE"), lines
    assert "ruled out" in lines["corruption"], lines
    if tensor_parallel:
        assert lines["collective"].startswith("collective: ruled out"), lines
        assert "0 failed since start" in lines["collective"] or "0 errors since start" in \
            lines["collective"], lines
    else:
        assert "not tensor-parallel" in lines["collective"], lines
    # Nothing is held but the leaked requests' blocks (their shared prefix block once).
    debug = httpx.get(f"{server.url}/debug/kv", timeout=10.0,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    held = debug["held_blocks_by_request"]
    assert sorted(held) == sorted(leak["request_ids"])
    assert 0 < gauge(server, "kvserve:kv_held_blocks") <= sum(held.values())
    finish(name, recording, tmp_path)


def test_tp_slow_rank_is_named_and_the_cache_ruled_out(live: dict[str, Server],
                                                       tmp_path: Path) -> None:
    server = live["tp_slow_leak"]
    recording = Recording()
    recording.scrape(server.url)
    last = SLOW_STEPS[1]
    past_slow = threading.Event()

    def load() -> None:
        seed = 0
        while not past_slow.is_set():
            assert complete(server, seed, 16) == "length"
            seed += 1
            steps = gauge(server, "kvserve:collective_rank_skew_seconds_count")
            if steps > last + 1:
                past_slow.set()

    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load)
        time.sleep(1.0)  # into the slow steps
        checkup = doctor(server.url, 3)
        while not past_slow.is_set() and not loading.done():
            recording.scrape(server.url)
            time.sleep(0.3)
        loading.result(timeout=120)
    code, rep = report(checkup)
    assert code == 1, rep
    assert problems(rep) == {"collective": "warning"}, rep
    (slow,) = [f for f in rep["findings"] if f["problem"] == "collective"]
    assert slow["title"] == "tensor-parallel all_reduce is slow"
    assert any("slowest rank 1" in e for e in slow["evidence"]), slow
    lines = differential(rep)
    assert lines["collective"].startswith("collective: THE CAUSE"), lines
    for cause in ("corruption", "leak", "thrashing", "saturation"):
        assert "ruled out" in lines[cause], lines
    wait_until(lambda: gauge(server, "kvserve:kv_held_blocks") == 0, 10.0, "no block held")
    assert gauge(server, "kvserve:collective_errors_total") == 0
    finish("tp_slow", recording, tmp_path)
    check_tp_panels(server)


def check_tp_panels(server: Server) -> None:
    """Every dashboard query on the tensor-parallel series reads what this live TP worker
    exports (its scrape becomes test_dashboard.py's data under KVSERVE_RECORD_FAULT_SERIES=1)."""
    text = server.metrics_text()
    exported = exported_names(text)
    tp_queries = {where: names for where, names in dashboard_queries(dashboard()).items()
                  if any(n.startswith(("kvserve:collective_", "kvserve:tp_",
                                       "kvserve:tensor_parallel")) for n in names)}
    assert len(tp_queries) >= 4, tp_queries
    missing = {where: sorted(names - exported) for where, names in tp_queries.items()
               if names - exported}
    assert not missing, missing
    if os.environ.get(RECORD_VAR) == "1":
        model = next(line.split('model_name="', 1)[1].split('"', 1)[0]
                     for line in text.splitlines() if 'model_name="' in line)
        TP_METRICS.parent.mkdir(parents=True, exist_ok=True)
        TP_METRICS.write_text(text.replace(model, "tiny-llama"))


def test_tp_leak_is_named_and_the_collectives_ruled_out(live: dict[str, Server],
                                                        tmp_path: Path) -> None:
    server = live["tp_slow_leak"]
    wait_until(lambda: gauge(server, "kvserve:collective_rank_skew_seconds_count")
               > SLOW_STEPS[1] + 1, 120.0, "the slow steps to be over")
    check_leak(server, "tp_leak", tmp_path, tensor_parallel=True)


def test_single_rank_leak_is_named(live: dict[str, Server], tmp_path: Path) -> None:
    check_leak(live["leak"], "leak", tmp_path, tensor_parallel=False)


def stream(server: Server, seed: int, max_tokens: int) -> None:
    began = time.monotonic()
    try:
        for _ in client(server).completions.create(
                model=client(server).models.list().data[0].id, max_tokens=max_tokens,
                prompt=[5 + (seed * 7 + i) % 280 for i in range(10)], temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            pass
    finally:
        assert time.monotonic() - began < REQUEST_BOUND_S


def check_corruption(server: Server, name: str, tmp_path: Path,
                     tensor_parallel: bool, streamed: bool) -> None:
    recording = Recording()
    recording.scrape(server.url)
    checkup = doctor(server.url, 3)
    if streamed:  # the stream ends with an error event
        with pytest.raises(openai.APIError) as failed:
            stream(server, 1, 12)
    else:
        with pytest.raises(openai.InternalServerError) as failed:
            complete(server, 1, 12)
    message = str(failed.value)
    assert "cache corruption detected" in message and "block " in message, message
    assert "epoch seen 1, now 2" in message, message
    seed = 2
    while checkup.poll() is None:  # the worker serves the next requests, in the doctor's window
        assert complete(server, seed, 4) == "length"
        seed += 1
        recording.scrape(server.url)
    code, rep = report(checkup)
    assert code == 2, rep
    assert problems(rep) == {"corruption": "critical"}, rep
    lines = differential(rep)
    assert lines["corruption"].startswith("corruption: THE CAUSE"), lines
    assert "ruled out" in lines["leak"], lines
    if tensor_parallel:
        assert lines["collective"].startswith("collective: ruled out: collectives healthy"), \
            lines
    else:
        assert "not tensor-parallel" in lines["collective"], lines
    assert gauge(server, "kvserve:kv_corruption_detections_total") == 1
    assert gauge(server, "kvserve:kv_held_blocks") == 0
    finish(name, recording, tmp_path)


def test_tp_corruption_is_named_not_a_collective_failure(live: dict[str, Server],
                                                         tmp_path: Path) -> None:
    check_corruption(live["tp_corruption"], "tp_corruption", tmp_path, tensor_parallel=True,
                     streamed=False)
    assert gauge(live["tp_corruption"], "kvserve:collective_errors_total") == 0


def test_single_rank_corruption_is_named(live: dict[str, Server], tmp_path: Path) -> None:
    check_corruption(live["corruption"], "corruption", tmp_path, tensor_parallel=False,
                     streamed=True)


def test_tp_lost_rank_is_named_and_the_worker_goes(live: dict[str, Server],
                                                   tmp_path: Path) -> None:
    server = live["tp_killed"]
    recording = Recording()
    recording.scrape(server.url)
    stop = threading.Event()

    def scrape_until_gone() -> None:
        while not stop.is_set():
            recording.scrape(server.url)
            if [s.get(UP) for s in recording.scrapes[-3:]] == [0, 0, 0]:
                return
            time.sleep(1.0)

    with ThreadPoolExecutor(1) as pool:
        scraping = pool.submit(scrape_until_gone)
        # The doctor's first read runs an audit (/debug/kv); the fault follows it, so its second
        # read, 3 s later, falls in the 5 s the failed worker reports before it exits.
        audits = gauge(server, "kvserve:kv_audit_runs_total")
        checkup = doctor(server.url, 3)
        wait_until(lambda: gauge(server, "kvserve:kv_audit_runs_total") > audits, 60.0,
                   "the doctor's first read")
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            complete(server, 3, 20)
        assert time.monotonic() - began < REQUEST_BOUND_S
        assert failed.value.status_code == 503
        assert "rank 1" in str(failed.value) and "rank_lost" in str(failed.value)
        code, rep = report(checkup)
        server.proc.wait(30.0)
        try:
            scraping.result(timeout=30.0)
        finally:
            stop.set()
    assert server.proc.returncode == 3
    assert code == 2, rep
    found = problems(rep)
    assert found.get("collective") == "critical", rep
    assert "corruption" not in found and "leak" not in found, rep
    (failure,) = [f for f in rep["findings"] if f["problem"] == "collective"]
    assert any("rank_lost" in e for e in failure["evidence"]), failure
    lines = differential(rep)
    assert lines["collective"].startswith("collective: THE CAUSE"), lines
    assert "ruled out" in lines["corruption"] and "ruled out" in lines["leak"], lines
    alive = [i for i, s in enumerate(recording.scrapes) if len(s) > 1]
    assert recording.value(alive[-1], "kvserve:kv_held_blocks") == 0  # last word: none held
    finish("tp_killed", recording, tmp_path)
