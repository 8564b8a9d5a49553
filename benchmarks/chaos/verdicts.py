"""The run's verdicts, from what it recorded (the files under its --out directory): requests
lost, the quiet checks (held blocks 0, audit clean), RSS / fds / threads growth after warm-up
against a stated bound, each fault's alerts and doctor findings, and alerts no fault explains.
Also the per-fault figures: time to detect, to name, to recover, requests affected."""

from __future__ import annotations

import bisect
import json
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.chaos.alerts import eval_minutes, firing
from benchmarks.chaos.faults import FAULTS
from benchmarks.chaos.load import REQUEST_TIMEOUT_S

RSS_BOUND_MIB, RSS_BOUND_FRACTION = 48.0, 0.10  # growth after warm-up: max of the two
FDS_BOUND, THREADS_BOUND = 16, 8
# A life shorter than this after its warm-up measures the warm-up, not a drift: a restarted
# tensor-parallel worker sat at 722 MiB until load reached it, then 795, then flat (soak-1205b).
# A run too short for any such life (the CI-sized one) judges its longest lives instead.
MIN_JUDGED_MINUTES = 5.0
STICKY = {"corruption": {"corruption"}}  # counted since start: still named after recovery
# What every fault may bring about under load, during it and while the fleet catches up:
# retries, clients resending, slow answers ("the fleet is saturated", a warning). Shown in the
# report; not counted as a cause the doctor failed to rule out.
CONSEQUENCES = {"saturation"}
# Alerts on the clients' answer to any fault that delays answers (SDK retries and resends):
# true while the fault lasts, so allowed in any fault's window, never outside one.
CONSEQUENCE_ALERTS = {"KVServeClientsResending", "KVServeGatewayRetryStorm",
                      "KVServeGatewayRejecting"}  # and load shed while capacity is down
RATE_WINDOW_MIN = 5  # the rules' rate windows: a condition may show this late


def alert_delays() -> dict[str, int]:
    """Each alert's `for`, in minutes of rule time (scrapes): how late it may fire."""
    import yaml  # type: ignore[import-untyped]

    from benchmarks.chaos.recorder import RULES

    out = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                out[rule["alert"]] = eval_minutes(str(rule.get("for", "0m")))
    return out


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alert_intervals(out: Path) -> list[dict[str, Any]]:
    """Each (alert, instance)'s firing spans: start and end unix times."""
    data = json.loads((out / "series.json").read_text())
    times: list[float] = data["times"]
    by_index = firing({k: (v[0], v[1]) for k, v in data["series"].items()}, out)
    spans: list[dict[str, Any]] = []
    open_: dict[tuple[str, str], int] = {}
    for i in range(len(times) + 1):
        now = by_index.get(i, set())
        for key in list(open_):
            if key not in now:
                spans.append({"alert": key[0], "instance": key[1], "start": times[open_[key]],
                              "end": times[min(i, len(times) - 1)]})
                del open_[key]
        for key in now:
            open_.setdefault(key, i)
    return sorted(spans, key=lambda s: s["start"])


def growth(rows: list[dict[str, Any]], after: float) -> list[dict[str, Any]]:
    """Per process incarnation (a restart begins a new one) alive long enough: first and last
    tenth's medians of RSS, fds, threads, after `after` (or 60 s after its start); `judged`
    where that span is MIN_JUDGED_MINUTES or more (or, in a shorter run, near its longest)."""
    out = []
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    incarnation: Counter[str] = Counter()
    alive_before: dict[str, bool] = {}
    for row in rows:
        name = row["proc"]
        if row["alive"] and not alive_before.get(name, False):
            incarnation[name] += 1
        alive_before[name] = row["alive"]
        if row["alive"]:
            runs.setdefault((name, incarnation[name]), []).append(row)
    for (name, inc), samples in runs.items():
        start = max(after, samples[0]["t"] + 60.0)
        samples = [s for s in samples if s["t"] >= start]
        if len(samples) < 20:
            continue
        tenth = max(3, len(samples) // 10)
        first, last = samples[:tenth], samples[-tenth:]
        row = {"proc": name, "incarnation": inc, "minutes": (samples[-1]["t"] - start) / 60}
        for key in ("rss_mib", "fds", "threads"):
            row[f"{key}_first"] = median(s[key] for s in first)
            row[f"{key}_last"] = median(s[key] for s in last)
        bound = max(RSS_BOUND_MIB, RSS_BOUND_FRACTION * row["rss_mib_first"])
        row["ok"] = (row["rss_mib_last"] - row["rss_mib_first"] <= bound
                     and row["fds_last"] - row["fds_first"] <= FDS_BOUND
                     and row["threads_last"] - row["threads_first"] <= THREADS_BOUND)
        out.append(row)
    longest = max((row["minutes"] for row in out), default=0.0)
    for row in out:
        row["judged"] = row["minutes"] >= min(MIN_JUDGED_MINUTES, 0.8 * longest)
    return out


def _scrape_time(times: list[float], index: int, interval: float) -> float:
    """When scrape `index` was taken (scrapes stretch on a loaded machine), or would be."""
    if index < len(times):
        return times[index]
    return (times[-1] if times else 0.0) + (index - len(times) + 1) * interval


def judge(out: Path) -> dict[str, Any]:
    run = json.loads((out / "run.json").read_text())
    requests = load_rows(out / "requests.jsonl")
    interval = float(run["config"]["interval_s"])
    settle = float(run["config"]["settle_s"])
    spans = alert_intervals(out)
    times = json.loads((out / "series.json").read_text())["times"]
    outcomes = Counter(r["outcome"] for r in requests)
    explained: set[int] = set()
    per_fault = []
    delays = alert_delays()
    for f in run["faults"]:
        fault = FAULTS[f["fault"]]
        back = f["recovered"] or f["end"]
        # an alert belongs to the fault if it starts firing while the fault lasts, or as late
        # after as its own `for` and rate window allow (in scrapes)
        # the scrape after it settled and after the clients' retries of requests it delayed
        settled = bisect.bisect_left(times, back + settle + REQUEST_TIMEOUT_S)
        fired = [i for i, s in enumerate(spans)
                 if f["inject"] <= s["start"] <= _scrape_time(
                     times, settled + delays.get(s["alert"], 0) + RATE_WINDOW_MIN + 1, interval)
                 and s["alert"] in fault.must | fault.may | CONSEQUENCE_ALERTS]
        explained |= set(fired)
        names = {spans[i]["alert"] for i in fired}
        during = set(f["doctor_during"]["problems"])
        after = set(f["doctor_after"]["problems"])
        affected = [r for r in requests if f["inject"] <= r["began"] <= back
                    and r["outcome"] not in ("answered", "hung_up")]
        firsts = [spans[i]["start"] for i in fired if spans[i]["alert"] in fault.must]
        per_fault.append({
            "fault": f["fault"], "target": f["target"], "inject": f["inject"],
            "recover": f["recover"], "recovered": f["recovered"],
            "alerts": sorted(names), "missing_alerts": sorted(fault.must - names),
            "detect_s": min(firsts) - f["inject"] if firsts else None,
            "doctor_during": sorted(during), "doctor_after": sorted(after),
            "named": fault.doctor is None or fault.doctor in during,
            "name_s": (f["doctor_during"]["ended"] - f["inject"]
                       if fault.doctor in during else None),
            "others_ruled_out": (
                during <= ({fault.doctor} if fault.doctor else set()) | fault.also | CONSEQUENCES
                and after <= STICKY.get(f["fault"], set()) | CONSEQUENCES),
            "recover_s": None if f["recovered"] is None else f["recovered"] - f["recover"],
            "affected": dict(Counter(r["outcome"] for r in affected)),
            "quiet_clean": f["quiet"]["clean"], "recover_error": f["recover_error"],
            "inject_error": f.get("inject_error")})
    unexplained = [s for i, s in enumerate(spans) if i not in explained]
    checks = run["quiet_checks"] + [f["quiet"] for f in run["faults"]]
    warm = run["began"] + float(run["config"]["warmup_s"])
    grown = growth(load_rows(out / "procs.jsonl"), warm)
    verdicts = {
        "lost_0": outcomes.get("lost", 0) == 0,
        "quiet_clean": all(c["clean"] for c in checks) and bool(checks),
        "flat": all(g["ok"] for g in grown if g["judged"]),
        "alerts_fired": all(not p["missing_alerts"] for p in per_fault),
        "doctor_named": all(p["named"] and p["others_ruled_out"] for p in per_fault),
        "no_unexplained_alert": not unexplained,
        "recovered": all(p["recovered"] is not None and not p["recover_error"]
                         and not p["inject_error"] for p in per_fault),
    }
    result = {"outcomes": dict(outcomes), "requests": len(requests), "faults": per_fault,
              "unexplained_alerts": unexplained, "alerts": spans, "growth": grown,
              "quiet_checks": len(checks), "verdicts": verdicts,
              "pass": all(verdicts.values()) and bool(per_fault),
              "bounds": {"min_minutes": MIN_JUDGED_MINUTES, "rss_mib": RSS_BOUND_MIB,
                         "rss_fraction": RSS_BOUND_FRACTION,
                         "fds": FDS_BOUND, "threads": THREADS_BOUND}}
    (out / "verdicts.json").write_text(json.dumps(result, indent=1))
    return result
