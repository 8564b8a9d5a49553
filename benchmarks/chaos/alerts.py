"""The alert rules of deploy/prometheus/alerts.yml evaluated by promtool's rule engine on the
series the recorder took: one scrape is one minute of rule time (the rules' windows and `for`
durations then span scrapes, as in tests/ops/fault_series.py), and at every scrape promtool is
asked which alerts fire. It is asked for none, so each firing alert comes back in its failure
report: that report is parsed into scrape index -> {(alertname, instance)}."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from benchmarks.chaos.recorder import RULES

_GOT = re.compile(r'\{alertname="([^"]+)", instance="([^"]+)"\}')
_TIME = re.compile(r"time: ([0-9ywdhms]+),")
_UNIT_MINUTES = {"y": 365 * 24 * 60, "w": 7 * 24 * 60, "d": 24 * 60, "h": 60, "m": 1}


def eval_minutes(text: str) -> int:
    """promtool's eval time (Prometheus's duration form: `1h5m`, `2d3h`, `45m`) in minutes."""
    parts = re.findall(r"(\d+)(ms|[ywdhms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_MINUTES.get(u, 0) for n, u in parts)


def _values(column: list[float | None]) -> str:
    out, seen = [], False
    for value in column:
        if value is None:
            out.append("stale" if seen else "_")
        else:
            out.append(repr(int(value)) if value == int(value) else repr(value))
        seen = value is not None
    return " ".join(out)


def firing(series: dict[str, tuple[str, list[dict[str, float]]]], work: Path,
           promtool: str | None = None) -> dict[int, set[tuple[str, str]]]:
    """Scrape index -> the (alert, instance) pairs firing there, by promtool."""
    import yaml  # type: ignore[import-untyped]

    tool = promtool or shutil.which("promtool")
    if tool is None:
        raise RuntimeError("promtool is not on PATH: `make tools` installs it (Debian package "
                           "`prometheus`)")
    length = max((len(s) for _, s in series.values()), default=0)
    inputs = []
    for _job, scrapes in series.values():
        keys = sorted({k for s in scrapes for k in s})
        for key in keys:
            pad = length - len(scrapes)  # a target added late (none today) reads as absent
            column = [None] * pad + [s.get(key) for s in scrapes]
            inputs.append({"series": key, "values": _values(column)})
    checks = [{"expr": 'group by (alertname, instance) (ALERTS{alertstate="firing"})',
               "eval_time": f"{i}m", "exp_samples": []} for i in range(length)]
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"name": "chaos run", "interval": "1m", "input_series": inputs,
                       "promql_expr_test": checks}]}
    path = work / "chaos_alerts_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1_000_000))
    done = subprocess.run([tool, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=1800, check=False)
    out: dict[int, set[tuple[str, str]]] = {i: set() for i in range(length)}
    current, in_got = None, False
    for line in (done.stdout + done.stderr).splitlines():
        if (m := _TIME.search(line)) is not None:
            current, in_got = eval_minutes(m.group(1)), False
        in_got = in_got or "got:" in line
        if in_got and current is not None:
            out[current] |= set(_GOT.findall(line))
    if done.returncode not in (0, 1) or ("FAILED" not in done.stdout + done.stderr
                                         and done.returncode == 1):
        raise RuntimeError(f"promtool failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out
