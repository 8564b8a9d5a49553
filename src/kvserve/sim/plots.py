"""PNG plots of simulation runs (matplotlib, Agg backend: no display needed).

- hit_rate.png: fleet prefix-cache hit rate per scrape interval (smoothed over a window).
- ttft_cdf.png: CDF of time to first token of answered requests, log scale.
- load.png: per-worker load (running + waiting) over time, one panel per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.sim.metrics import SimResult, TimelineSample

SMOOTHING_S = 30.0


def _matplotlib() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hit_rate_series(timeline: Sequence[TimelineSample],
                    window_s: float = SMOOTHING_S) -> tuple[list[float], list[float]]:
    """(times, hit rate of the tokens queried in the preceding `window_s`), from the
    cumulative counters; points with no queries in their window are left out."""
    times: list[float] = []
    rates: list[float] = []
    start = 0
    for sample in timeline:
        while timeline[start].t < sample.t - window_s:
            start += 1
        first = timeline[start]
        queries = sample.query_tokens - first.query_tokens
        if queries > 0:
            times.append(sample.t)
            rates.append((sample.hit_tokens - first.hit_tokens) / queries)
    return times, rates


def write_plots(results: Sequence[SimResult], out_dir: Path, title: str) -> list[Path]:
    """Write the three PNGs into `out_dir`; returns their paths."""
    plt = _matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "hit_rate.png", out_dir / "ttft_cdf.png", out_dir / "load.png"]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        times, rates = hit_rate_series(r.timeline)
        ax.plot(times, [x * 100 for x in rates], label=r.label, linewidth=1.2)
    ax.set(xlabel="simulated time (s)", ylabel=f"hit rate, {SMOOTHING_S:.0f} s window (%)",
           title=f"{title}: prefix-cache hit rate", ylim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        ttfts = sorted(r.ttfts)
        if ttfts:
            ys = [(i + 1) / r.num_requests * 100 for i in range(len(ttfts))]
            ax.step([max(t, 1e-3) for t in ttfts], ys, where="post", label=r.label)
    if results:
        ax.axvline(results[0].slo_s, color="grey", linestyle="--", linewidth=1, label="SLO")
    ax.set(xscale="log", xlabel="time to first token (s)",
           ylabel="requests answered within (% of all)", title=f"{title}: TTFT CDF",
           ylim=(0, 100))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    rows = max(len(results), 1)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.2 * rows), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=False):
        times = [s.t for s in r.timeline]
        for idx in range(r.num_workers):
            ax.plot(times, [s.load[idx] for s in r.timeline], linewidth=0.7)
        ax.set_ylabel("load")
        ax.set_title(f"{r.label}: running + waiting per worker", fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(f"{title}: load per worker")
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.35 / (2.2 * rows)))
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths
