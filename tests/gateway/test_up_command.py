"""`kvserve up` offers one URL and one curl, the gateway's, which answers; it stops its workers
when it is stopped, by SIGINT or by SIGTERM."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from kvserve.runtime.demo_model import ensure_demo_model

from .processes import WORKER_FLAGS, Process, wait_until

# The small random-weight demo model where the model does not matter: the real default's
# start-up and answers are checked in test_up_real_model.py.
DEMO = f"--model={ensure_demo_model()}"


def _serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_stopping_up_stops_its_workers(tmp_path: Path, sig: signal.Signals) -> None:
    worker_args = [f"--worker-arg={flag}" for flag in WORKER_FLAGS]
    up = Process("up", ["up", "--workers", "1", DEMO, *worker_args], tmp_path)
    try:
        up.wait_ready(lambda r: r.status_code == 200)
        workers = re.findall(r"worker at (http://127\.0\.0\.1:\d+), behind the gateway at "
                             + re.escape(up.url), up.log())
        assert len(workers) == 1 and _serving(workers[0]), up.log()
        _answers_the_one_curl_offered(up.log(), up.url)
        listing = up.get("/workers").json()  # the gateway's own defaults, no option of up's
        assert listing["policy"] == "cache_aware", listing
        assert listing["policy_options"] == {}, listing
        up.proc.send_signal(sig)
        up.proc.wait(60.0)
        wait_until(lambda: not _serving(workers[0]), 30.0, f"worker {workers[0]} to stop",
                   up.log)
    finally:
        up.stop(30.0)  # SIGINT: up stops its workers (SIGKILL would orphan them)


def _answers_the_one_curl_offered(log: str, gateway_url: str) -> None:
    offered = [line for line in log.splitlines() if "curl " in line]
    assert len(offered) == 1 and f"curl {gateway_url}/v1/" in offered[0], log
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the offered command was checked, not run")
    argv = shlex.split(offered[0].split("try: ", 1)[1])
    done = subprocess.run([*argv, "--silent", "--fail", "--max-time", "60"],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and '"choices"' in done.stdout, (done, log)


def test_up_and_a_gateway_route_cache_aware_unless_told() -> None:
    """cache_aware by default, alone or one of several replicas (a new prefix goes where every
    replica puts it)."""
    from kvserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["up"]).policy == "cache_aware"
    assert parser.parse_args(["up", "--policy", "precise"]).policy == "precise"
    assert parser.parse_args(["gateway", "--worker", "http://w"]).policy == "cache_aware"
    assert parser.parse_args(["gateway", "--worker", "http://w", "--policy",
                              "prefix_hash"]).policy == "prefix_hash"


def test_up_and_a_gateway_place_new_prefixes_by_one_rule() -> None:
    """`kvserve up` routes exactly as `kvserve gateway` given the same flags: no option of its
    own (a new prefix goes where every replica would put it, unless the operator says)."""
    from kvserve.cli import build_parser
    from kvserve.gateway.cli.gateway import settings_from_args

    parser = build_parser()
    secret = ["--salt-secret", "s" * 32]
    up = settings_from_args(parser.parse_args(["up", *secret]), ["http://w"])
    gateway = settings_from_args(parser.parse_args(["gateway", "--worker", "http://w", *secret]),
                        ["http://w"])
    assert up.policy == gateway.policy == "cache_aware"
    assert up.policy_options == gateway.policy_options == ()


def test_up_with_precise_has_its_workers_publish_kv_events_to_its_gateway(
        tmp_path: Path) -> None:
    """`up --policy precise` starts each worker with --kv-events-config and follows it over
    ZMQ: the index is synced and a repeated prompt is routed as a hit on its blocks."""
    worker_args = [f"--worker-arg={flag}" for flag in WORKER_FLAGS]
    up = Process("up", ["up", "--workers", "1", "--policy", "precise", *worker_args], tmp_path)
    try:
        up.wait_ready(lambda r: r.status_code == 200)
        [worker] = up.get("/workers").json()["workers"]
        assert worker["kv_events"]["source"] == "zmq" and worker["kv_events"]["synced"]
        model = up.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Every clause of the lease, read twice. " * 8,
                "max_tokens": 2}
        httpx.post(f"{up.url}/v1/completions", json=body, timeout=60).raise_for_status()
        wait_until(lambda: up.metrics().value("kvserve:gateway_kv_events_total",
                                              type="stored") > 0, 15.0, "stored events", up.log)
        httpx.post(f"{up.url}/v1/completions", json=body, timeout=60).raise_for_status()
        assert up.metrics().value("kvserve:gateway_requests_total", branch="precise_hit") == 1
        assert "no KV events from" not in up.log()
    finally:
        up.stop(30.0)
