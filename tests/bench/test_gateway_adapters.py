"""`python -m benchmarks gateway --adapters N`: tenants on LoRA adapters, every worker serving
them, adapter loads per request counted from the workers (kvserve.bench.gateway_lora)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import with_repo_on_path
from benchmarks.gateway_adapters import check_adapter_arguments
from kvserve.bench.gateway_counters import CounterTotals
from kvserve.bench.gateway_fleet import RouterSpec
from kvserve.bench.gateway_load import ClientPolicy, send_request
from kvserve.bench.gateway_lora import FleetAdapters, LogLineCount, kvserve_loads
from kvserve.bench.gateway_workload import GatewayRequest, ideal_assignment


def _fake_writer(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    out.mkdir(parents=True)
    return out


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    return model


def test_every_worker_serves_all_adapters_and_tenants_map_to_them_modulo_n(
        model_dir: Path, tmp_path: Path) -> None:
    adapters = FleetAdapters.write(model_dir, tmp_path / "a", 6, 2, 12, _fake_writer)
    assert adapters.names == tuple(f"adapter-{i}" for i in range(6))
    assert adapters.slot_rank == 16  # the smallest rank vLLM accepts that holds 12
    args = adapters.worker_args()
    assert args[:7] == ("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "6",
                        "--max-lora-rank", "16")
    assert args[7:] == ("--lora-modules", *(f"adapter-{i}={tmp_path / 'a' / f'adapter-{i}'}"
                                            for i in range(6)))
    assert [adapters.adapter_for(f"tenant-{t}") for t in (0, 5, 6, 11)] == [
        "adapter-0", "adapter-5", "adapter-0", "adapter-5"]
    with pytest.raises(ValueError, match="tenant-<number>"):
        adapters.adapter_for("default")


@pytest.mark.parametrize(("sizes", "message"), [
    ((0, 1, 8), "at least one adapter"),
    ((2, 3, 8), "between 1 and --adapters"),
    ((2, 2, 600), "vLLM's largest slot"),
])
def test_adapter_sizes_out_of_range_are_refused(model_dir: Path, tmp_path: Path,
                                                sizes: tuple[int, int, int],
                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetAdapters.write(model_dir, tmp_path / "a", *sizes, _fake_writer)


def test_a_model_without_safetensors_weights_takes_no_adapters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no safetensors weights"):
        FleetAdapters.write(tmp_path, tmp_path / "a", 2, 1, 8, _fake_writer)


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"adapters": None, "max_loras": None, "adapter_rank": None,
                               "calibrate": None}
    return argparse.Namespace(**(base | kw))


def test_adapter_flags_that_do_not_go_together_are_refused() -> None:
    cache_aware = [RouterSpec.parse("kvserve:cache_aware")]
    with pytest.raises(ValueError, match="give --adapters N too"):
        check_adapter_arguments(_args(max_loras=2), cache_aware)
    with pytest.raises(ValueError, match="drop it with --adapters"):
        check_adapter_arguments(_args(adapters=2, calibrate="zero"), cache_aware)
    with pytest.raises(ValueError, match="sglang:cache_aware cannot be measured"):
        check_adapter_arguments(_args(adapters=2), [RouterSpec.parse("sglang:cache_aware")])
    args = _args(adapters=6)
    check_adapter_arguments(args, cache_aware)
    assert (args.max_loras, args.adapter_rank) == (2, 8)


def test_vllm_activations_are_counted_from_whole_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    count = LogLineCount(log)
    assert count() == 0.0  # no file yet
    line = "DEBUG 12-05 08:00:00 [model_manager.py:366] Activating LoRA. int id: 3, slot index: 0\n"
    log.write_text("INFO starting\n" + line + line[:30])  # the last line is half written
    assert count() == 1.0
    with log.open("a") as f:
        f.write(line[30:] + "INFO Added request\n")
    assert count() == 2.0 and count() == 2.0


def test_kvserve_loads_sum_over_adapters_and_survive_a_restart() -> None:
    page = ('# TYPE kvserve:lora_adapter_loads counter\n'
            'kvserve:lora_adapter_loads_total{adapter="adapter-0"} 3.0\n'
            'kvserve:lora_adapter_loads_total{adapter="adapter-1"} 2.0\n')
    assert kvserve_loads(page) == 5.0 and kvserve_loads("") == 0.0
    totals = CounterTotals()
    for queries, loads in ((10, 5), (20, 9), (4, 2)):  # the last reading: a restarted worker
        totals.add(queries, 0, loads)
    assert totals.loads == 4 + 2 and totals.queries == 10 + 4


def test_the_ideal_split_pins_whole_adapter_groups() -> None:
    requests = [GatewayRequest(f"r{t}", 0.0, f"tenant-{t}", "x", 100 * (t + 1), 1)
                for t in range(4)]
    home = ideal_assignment(requests, 2, group_of=lambda t: f"a{int(t[-1]) % 2}")
    assert home["tenant-0"] == home["tenant-2"] != home["tenant-1"] == home["tenant-3"]


def test_a_request_names_its_adapter_and_a_clean_error_is_not_lost() -> None:
    models: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        models.append(json.loads(request.content)["model"])
        return httpx.Response(404, json={"error": {"message": "no such adapter"}})

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def send(handler: object) -> tuple[bool, int | None, str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            request = GatewayRequest("r0", 0.0, "tenant-1", "hi", 1, 1, "adapter-1")
            result = await send_request(client, request, "base", lambda r, n: "http://w",
                                        ClientPolicy(max_retries=1, error_backoff_s=0.0))
        return result.ok, result.final_status, result.error

    assert asyncio.run(send(refuse))[:2] == (False, 404)
    assert models == ["adapter-1", "adapter-1"]  # its adapter, not the run's model; resent once
    assert asyncio.run(send(unreachable))[:2] == (False, None)  # no answer: lost


def test_a_small_adapter_run_counts_loads_per_request_and_loses_nothing(tmp_path: Path) -> None:
    """Real kvserve workers serving adapters behind a real `kvserve gateway`: prefix + adapter
    affinity and prefix only, each from a cold fleet."""
    out = tmp_path / "gw.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gateway", "--cases", "base", "--adapters", "3",
         "--max-loras", "1", "--routers", "kvserve:cache_aware,kvserve:cache_aware@"
         "adapter_weight=0", "--tenants", "4", "--requests", "12", "--rate", "8",
         "--prefix-tokens", "512,768", "--suffix-tokens", "16,32", "--output-tokens", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=with_repo_on_path(os.environ),
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA adapters: loads into a slot" in proc.stdout
    report = json.loads(out.read_text())
    assert "kvserve:lora_adapter_loads_total" in report["adapter_loads_counted"]
    runs = {r["router"]: r for r in report["runs"]}
    assert set(runs) == {"kvserve:cache_aware", "kvserve:cache_aware@adapter_weight=0"}
    for run in runs.values():
        assert run["completed"] == run["requests"] == 12, run
        assert run["lost"] == run["errored"] == run["unanswered"] == 0
        assert 0.0 < run["hit_rate"] < 1.0
        loads = run["adapter_loads"]
        # Two workers from cold (empty slots): each loads at least the adapter it serves
        # first, and at most one per request (one slot, one adapter a step).
        assert len(loads) == 2 and all(x >= 1 for x in loads if x is not None), loads
        assert 2 <= sum(loads) <= 12
        assert run["adapter_loads_per_request"] == pytest.approx(sum(loads) / 12)
