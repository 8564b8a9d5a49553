"""`kvserve doctor` as its own process, on a gateway (which it follows to every worker),
reduced to what the verdicts read: each problem above info, by target."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from benchmarks.chaos.fleet import ADMIN_KEY
from benchmarks.chaos.procs import kvserve_argv


def run_doctor(urls: list[str], interval_s: float = 2.0) -> dict[str, Any]:
    began = time.time()
    try:
        done = subprocess.run(kvserve_argv("doctor", *urls, "--json", "--interval",
                                           str(interval_s), "--admin-key", ADMIN_KEY,
                                           "--timeout", "5"),
                              capture_output=True, text=True, timeout=120, check=False)
        report = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        return {"t": began, "ended": time.time(), "error": str(exc)[:300], "problems": {}}
    problems: dict[str, list[str]] = {}
    for f in report.get("findings", []):
        if f["severity"] != "info":
            evidence = "; ".join(f["evidence"][:2])
            problems.setdefault(f["problem"], []).append(
                f"{f['target']}: {f['title']} ({evidence})"[:300])
    diff = [line for f in report.get("findings", [])
            if f["title"].startswith("differential diagnosis") for line in f["evidence"]]
    return {"t": began, "ended": time.time(), "exit": done.returncode, "problems": problems,
            "differential": diff[:12]}
