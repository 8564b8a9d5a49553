"""`kvserve doctor URL...`: read live workers and gateways twice, some seconds apart, and say
what is wrong with evidence. Exit status: 0 healthy, 1 warnings, 2 something critical."""

from __future__ import annotations

import argparse
import json
import os

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvserve.ops.diagnose import diagnose
from kvserve.ops.findings import Report, Severity, TargetSummary
from kvserve.ops.scrape import Reader, discover, observe

STYLES = {Severity.INFO: "cyan", Severity.WARNING: "yellow", Severity.CRITICAL: "bold red"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="diagnose live workers and gateways (leaks, corruption, "
                                      "prefix and adapter thrashing, saturation, "
                                      "misconfiguration)")
    p.add_argument("urls", nargs="+", metavar="URL",
                   help="a worker's or gateway's base URL (kind told from its /metrics)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between the two reads that rates come from (default 5)")
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    p.add_argument("--no-follow", dest="follow", action="store_false",
                   help="read only the URLs given, not also the workers a gateway lists")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="key for workers' /v1 routes (env KVSERVE_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ADMIN_KEY"),
                   help="the workers' --admin-key, for their /debug/kv (env KVSERVE_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.interval < 0 or args.timeout <= 0:
        Console(stderr=True).print("[red]--interval must be >= 0 and --timeout > 0[/]")
        return 2
    urls = [u if "://" in u else f"http://{u}" for u in args.urls]
    err = Console(stderr=True)
    with httpx.Client(timeout=args.timeout) as client:
        reader = Reader(client, api_key=args.api_key, admin_key=args.admin_key)
        targets = discover(reader, urls, args.follow)
        with err.status(f"reading {len(targets)} target(s) twice, {args.interval:g}s apart …"):
            observations = observe(reader, targets, args.interval)
    report = diagnose(observations)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report, Console(highlight=False))
    return report.exit_code


def _describe(target: TargetSummary) -> str:
    f = target.facts
    if "error" in f:
        return str(f["error"])
    if "policy" in f:
        rate = f.get("fleet_hit_rate")
        return (f"policy {f['policy']}, {f['healthy_workers']}/{f['workers']} workers healthy, "
                f"{f['routed']:.0f} routed, fleet hit rate "
                f"{'-' if rate is None else f'{rate:.0%}'}")
    parts = []
    if "blocks" in f:
        parts.append(f"{f['held_blocks']:.0f} of {f['blocks']:.0f} blocks held "
                     f"(block size {f['block_size']})")
    parts.append(f"{f.get('running', 0):.0f} running, {f.get('waiting', 0):.0f} waiting, "
                 f"KV usage {f.get('kv_usage', 0):.0%}")
    for key, label in (("hit_rate_window", "window"), ("hit_rate_since_start", "since start")):
        if f.get(key) is not None:
            parts.append(f"hit rate {f[key]:.0%} ({label})")
    return ", ".join(parts)


def render(report: Report, console: Console) -> None:
    """The report for people: targets, then findings with their evidence, then the verdict."""
    table = Table(title=f"kvserve doctor: {len(report.targets)} target(s), read "
                        f"{report.interval_s:.1f}s apart", title_justify="left")
    table.add_column("kind")
    table.add_column("url")
    table.add_column("state")
    for target in report.targets:
        table.add_row(target.kind, target.url, escape(_describe(target)))
    console.print(table)
    for finding in report.findings:
        style = STYLES[finding.severity]
        console.print(f"[{style}]{finding.severity.name}[/] [bold]{finding.problem.value}[/] "
                      f"{escape(finding.target)}: {escape(finding.title)}", soft_wrap=True)
        for line in finding.evidence:
            console.print(f"    - {escape(line)}", soft_wrap=True)
        if finding.request_ids:
            console.print(f"    requests: {escape(', '.join(finding.request_ids))}",
                          soft_wrap=True)
    problems = report.problems
    skipped = [f.target for f in report.findings if f.title.startswith("not checked on ")]
    if not problems:
        if skipped:
            console.print(f"[green]healthy[/]: nothing wrong found in what could be checked; "
                          f"{len(skipped)} target(s) lack kvserve metrics, so the checks "
                          f"listed above were not run there ({escape(', '.join(skipped))})",
                          soft_wrap=True)
        else:
            console.print("[green]healthy[/]: nothing wrong found")
        return
    counts = {s: sum(1 for f in problems if f.severity is s)
              for s in (Severity.CRITICAL, Severity.WARNING)}
    console.print(f"[{STYLES[report.severity]}]{counts[Severity.CRITICAL]} critical, "
                  f"{counts[Severity.WARNING]} warning(s)[/] (exit {report.exit_code})")
