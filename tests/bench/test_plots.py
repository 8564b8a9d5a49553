"""`--plot DIR`: the engine and gateway benchmarks and the simulator write their PNGs from their
own results, and a missing matplotlib is refused before any run starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main as benchmarks_main
from kvserve.bench.gateway_report import CaseRun
from kvserve.bench.plots import GATEWAY_CDF_PNG, GATEWAY_HIT_PNG, gateway_plots
from kvserve.cli import main
from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config

SMALL_ENGINE = ["--num-prompts", "2", "--prompt-len", "9", "--output-len", "4", "--prefix-len",
                "20", "--suffix-len", "5", "--prefix-output-len", "3", "--kv-cache-gib", "0.01",
                "--threads", "1", "--max-model-len", "256", "--peer", "none",
                "--no-machine-limits"]
PNG = b"\x89PNG\r\n\x1a\n"


def pixels(path: Path) -> int:
    """How many distinct colours the PNG has: a plot with data has many, a blank one few."""
    plt = pytest.importorskip("matplotlib.pyplot")
    image = plt.imread(path)
    return len({tuple(p) for row in image[::4] for p in row[::4]})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("plots") / "m", base_config(), seed=3)


def test_engine_bench_plots_its_own_tokens_per_second(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "img"
    assert main(["bench", "engine", "--model", str(model_dir), *SMALL_ENGINE,
                 "--plot", str(out)]) == 0
    png = out / "engine_tokens_per_s.png"
    assert png.read_bytes()[:8] == PNG and pixels(png) > 20


def test_plot_without_matplotlib_is_refused_before_the_run(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main(["bench", "engine", "--model", str(model_dir), *SMALL_ENGINE,
                 "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvserve[plot]'" in err and "running kvserve" not in err
    assert benchmarks_main(["gateway", "--plot", str(tmp_path)]) == 2
    assert "pip install 'kvserve[plot]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _run(case: str, router: str, seed: int, hit: float, ttfts: list[float]) -> CaseRun:
    return CaseRun(case=case, router=router, replicas=1, requests=len(ttfts) + 1,
                   completed=len(ttfts), lost=1, hit_rate=hit, ttft_ms={}, e2e_ms={},
                   request_throughput=4.0, retries=0, rejections=0, worker_shares=[0.5, 0.5],
                   duration_s=40.0, seed=seed, ttfts_ms=sorted(ttfts))


def test_gateway_plots_draw_hit_rate_and_ttft_cdf_per_case(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [_run(case, router, seed, hit, [20.0 + 7 * i * (seed + 1) for i in range(40)])
            for case in ("base", "skew") for seed in (0, 1)
            for router, hit in (("ideal", 0.91), ("kvserve:cache_aware", 0.90 - seed / 100))]
    paths = gateway_plots(runs, tmp_path, "test")
    assert [p.name for p in paths] == [GATEWAY_HIT_PNG, GATEWAY_CDF_PNG]
    for path in paths:
        assert path.read_bytes()[:8] == PNG and pixels(path) > 20


def test_simulate_plot_writes_the_pngs_alone(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "img"
    assert main(["simulate", "--trace", "multi-tenant", "--tenants", "4", "--requests", "40",
                 "--rate", "2", "--workers", "2", "--capacity-tokens", "80000", "--block-size",
                 "64", "--policy", "round_robin,cache_aware", "--jobs", "1",
                 "--plot", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["hit_rate.png", "load.png", "ttft_cdf.png"]
    assert pixels(out / "hit_rate.png") > 20
