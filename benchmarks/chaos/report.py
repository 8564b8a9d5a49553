"""The run's report: report.md and PNG plots (matplotlib) in its --out directory, from the
verdicts (`verdicts.judge`): a timeline of faults, alerts, doctor findings and request
outcomes; per process RSS, fds and threads; per worker held and free blocks; a table per fault
(time to detect, to name, to recover, requests affected) and the verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.chaos.verdicts import judge, load_rows

COLORS = {"answered": "tab:green", "retried": "tab:olive", "clean_error": "tab:orange",
          "lost": "tab:red", "hung_up": "tab:gray"}


def write_report(out: Path) -> dict[str, Any]:
    result = judge(out)
    run = json.loads((out / "run.json").read_text())
    t0 = run["began"]
    _timeline(out, run, result, t0)
    _processes(out, t0)
    _blocks(out, t0)
    (out / "report.md").write_text(markdown(run, result))
    return result


def _m(t: float, t0: float) -> float:
    return (t - t0) / 60.0


def _timeline(out: Path, run: dict[str, Any], result: dict[str, Any], t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1.3]})
    rows: list[str] = []

    def row(label: str) -> int:
        if label not in rows:
            rows.append(label)
        return rows.index(label)

    for f in run["faults"]:
        y = row(f"fault: {f['fault']}")
        end = f["recovered"] or f["end"]
        top.broken_barh([(_m(f["inject"], t0), _m(end, t0) - _m(f["inject"], t0))],
                        (y - 0.4, 0.8), color="tab:red", alpha=0.6)
        for key, marker in (("doctor_during", "v"), ("doctor_after", "^")):
            doc = f[key]
            named = bool(doc["problems"])
            top.plot(_m(doc["ended"], t0), y, marker, color="black" if named else "tab:green",
                     ms=6)
    for span in result["alerts"]:
        y = row(f"alert: {span['alert']}")
        width = max(_m(span["end"], t0) - _m(span["start"], t0), 0.05)
        top.broken_barh([(_m(span["start"], t0), width)], (y - 0.4, 0.8), color="tab:purple")
    top.set_yticks(range(len(rows)), rows, fontsize=7)
    top.set_title("faults (red), alerts firing (purple); doctor during (v) and after (^): "
                  "black = found a problem, green = clean")
    requests = load_rows(out / "requests.jsonl")
    for outcome, color in COLORS.items():
        pts = [r for r in requests if r["outcome"] == outcome]
        bottom.scatter([_m(r["began"], t0) for r in pts],
                       [r["ended"] - r["began"] for r in pts], s=4, color=color,
                       label=f"{outcome} ({len(pts)})")
    bottom.set_yscale("log")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("minutes since start")
    bottom.legend(fontsize=7, loc="upper right", markerscale=3)
    fig.tight_layout()
    fig.savefig(out / "chaos_timeline.png", dpi=110)
    plt.close(fig)


def _processes(out: Path, t0: float) -> None:
    import matplotlib.pyplot as plt

    rows = load_rows(out / "procs.jsonl")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(axes, ("rss_mib", "fds", "threads"),
                              ("RSS (MiB)", "open fds", "threads"), strict=True):
        for name in sorted({r["proc"] for r in rows}):
            pts = [r for r in rows if r["proc"] == name and r["alive"]]
            ax.plot([_m(r["t"], t0) for r in pts], [r[key] for r in pts], ".", ms=2,
                    label=name)
        ax.set_title(label)
        ax.set_xlabel("minutes since start")
    axes[0].legend(fontsize=7, markerscale=4)
    fig.tight_layout()
    fig.savefig(out / "chaos_processes.png", dpi=110)
    plt.close(fig)


def _blocks(out: Path, t0: float) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in load_rows(out / "kv.jsonl") if r.get("answered")]
    fig, ax = plt.subplots(figsize=(12, 3.5))
    for name in sorted({r["worker"] for r in rows}):
        pts = [r for r in rows if r["worker"] == name]
        ax.plot([_m(r["t"], t0) for r in pts], [r["held"] for r in pts], ".", ms=3,
                label=f"{name} held")
        bad = [r for r in pts if not r["audit_ok"]]
        ax.plot([_m(r["t"], t0) for r in bad], [0] * len(bad), "rx", ms=8,
                label=f"{name} audit failed" if bad else None)
    ax.set_ylabel("held KV blocks")
    ax.set_xlabel("minutes since start")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "chaos_blocks.png", dpi=110)
    plt.close(fig)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(run: dict[str, Any], result: dict[str, Any]) -> str:
    minutes = (run["ended"] - run["began"]) / 60
    lines = [f"# Soak and chaos: {minutes:.1f} minutes, {result['requests']} requests, "
             f"{len(result['faults'])} faults", "",
             f"Outcomes: {json.dumps(result['outcomes'])}", "",
             "| verdict | holds |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**NO**'} |" for k, v in result["verdicts"].items()]
    b = result["bounds"]
    lines += ["", f"Growth bound after warm-up, per process incarnation alive >= 60 s: RSS "
              f"<= max({b['rss_mib']:.0f} MiB, {b['rss_fraction']:.0%}), fds <= {b['fds']}, "
              f"threads <= {b['threads']} (first against last tenth of its samples).", "",
              "| fault | target | alerts fired | missing | detect s | doctor during | "
              "doctor after | name s | recover s | affected | quiet clean |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["faults"]:
        lines.append(f"| {p['fault']} | {p['target']} | {', '.join(p['alerts']) or '-'} | "
                     f"{', '.join(p['missing_alerts']) or '-'} | {_s(p['detect_s'])} | "
                     f"{', '.join(p['doctor_during']) or '-'} | "
                     f"{', '.join(p['doctor_after']) or '-'} | {_s(p['name_s'])} | "
                     f"{_s(p['recover_s'])} | {json.dumps(p['affected'])} | "
                     f"{'yes' if p['quiet_clean'] else '**NO**'} |")
    if run.get("skipped"):
        lines += ["", "Fault classes not run: " + "; ".join(
            f"{name} ({why})" for name, why in run["skipped"].items())]
    if result["unexplained_alerts"]:
        lines += ["", "Alerts no injected fault explains:"]
        lines += [f"- {s['alert']} on {s['instance']} at "
                  f"{(s['start'] - run['began']) / 60:.1f} min" for s in
                  result["unexplained_alerts"]]
    lines += ["", "| process | incarnation | minutes | RSS MiB first→last | fds | threads | ok |",
              "|---|---|---|---|---|---|---|"]
    for g in result["growth"]:
        lines.append(f"| {g['proc']} | {g['incarnation']} | {g['minutes']:.0f} | "
                     f"{g['rss_mib_first']:.0f}→{g['rss_mib_last']:.0f} | "
                     f"{g['fds_first']:.0f}→{g['fds_last']:.0f} | "
                     f"{g['threads_first']:.0f}→{g['threads_last']:.0f} | "
                     f"{('yes' if g['ok'] else '**NO**') if g['judged'] else 'too short'} |")
    lines += ["", "![timeline](chaos_timeline.png)", "![processes](chaos_processes.png)",
              "![blocks](chaos_blocks.png)", ""]
    return "\n".join(lines)
