"""`python -m benchmarks chaos`, CI-sized: two workers behind two gateway replicas, a hung
worker (SIGSTOP, then SIGCONT) and a worker's KV events blackholed then its link reset, under
open-loop load through the openai SDK. Its verdicts must all hold: no request lost, held blocks
back to 0 and the audit clean after each fault, RSS and fds within the bound, the hung worker's
alert fired (promtool) and the doctor named it and nothing else, no alert without a fault."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def test_a_short_chaos_run_holds_every_verdict(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not on PATH: `make tools` installs it (Debian `prometheus`)")
    out = tmp_path / "chaos"
    argv = [sys.executable, "-m", "benchmarks", "chaos", "--out", str(out), "--workers", "2",
            "--no-envoy", "--faults", "worker_stop,events_dropped", "--cycles", "1",
            "--rps", "1.5", "--warmup-s", "8", "--settle-s", "4", "--interval-s", "2",
            "--hold-scale", "0.4"]
    # About 100 s on two idle cores; generous, as CI machines are often busy. On a timeout
    # the harness gets SIGTERM, on which it stops its fleet (SIGKILL would orphan it).
    proc = subprocess.Popen(argv, cwd=REPO, env=with_repo_on_path(os.environ), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"the chaos run took over {TIMEOUT_S} s:\n{stderr[-3000:]}")
    verdicts_path = out / "verdicts.json"
    assert verdicts_path.exists(), stdout[-3000:] + stderr[-3000:]
    result = json.loads(verdicts_path.read_text())
    assert [f["fault"] for f in result["faults"]] == ["worker_stop", "events_dropped"]
    assert result["outcomes"].get("lost", 0) == 0, result["outcomes"]
    assert result["requests"] > 20, result["outcomes"]
    failed = {k: v for k, v in result["verdicts"].items() if not v}
    assert not failed, json.dumps({"failed": failed, "faults": result["faults"],
                                   "unexplained": result["unexplained_alerts"]}, indent=1)
    assert proc.returncode == 0, stderr[-3000:]
    stop = result["faults"][0]
    assert "KVServeWorkerScrapeDown" in stop["alerts"] and stop["doctor_during"] == ["down"]
    assert (out / "report.md").exists() and (out / "chaos_timeline.png").exists()
