"""LoRA adapters in `python -m benchmarks gateway --adapters N`: what every worker serves, which
adapter each tenant's requests name, and how each kind of worker's adapter loads are counted.

Every worker (kvserve's or vLLM's) serves the same N adapters, `adapter-0` .. `adapter-{N-1}`,
started with `--enable-lora --lora-modules NAME=PATH ... --max-loras K --max-cpu-loras N
--max-lora-rank R`: K adapters run in one batch (the device slots), all N stay in host memory, so
a load is a copy into a slot, never a disk read. Tenant `tenant-<t>` (the workload generator's
names) sends every request with `model` = `adapter-<t mod N>`; the gateway learns the adapters
from the workers' `/v1/models` (kvserve.gateway.core.adapters), so no `--tenant-adapter` is
passed.

Adapter loads, per worker, over a run (a `LoadReader` each, summed by gateway_counters.py):

- kvserve: the increase of `kvserve:lora_adapter_loads_total` (summed over its adapters): an
  adapter copied into a device slot (kvserve.server.lora_metrics).
- vLLM 0.32 (the CPU build) exports no load counter: its only LoRA metric is
  `vllm:lora_requests_info` (which adapters run and wait, not what was loaded). What is
  counted are the lines its `LoRAModelManager.activate_adapter` (vllm/lora/model_manager.py)
  logs at DEBUG, "Activating LoRA. int id: I, slot index: S", one each time an adapter is copied
  into a slot (the least recently used one is evicted first when all K are taken): the same
  event kvserve counts. The workers run with a logging config (`vllm_worker_env`) that turns
  that one logger to DEBUG, and the line is counted in the worker's log file as it grows.
  Limits: vLLM also activates an adapter each time one is registered (at startup, for
  `--lora-modules`, and at the reload that resets the slots between routers): those lines come
  before a run's baseline and are not counted, but a worker restarted during a run
  (the `failover` case) adds its startup's N activations; and a line is counted only once the
  engine process has written it (the run's last poll comes 1.5 s after the last answer).

Cold slots between routers: kvserve workers are restarted (their slots start empty); vLLM workers
keep running, so `reset_vllm_adapters` unloads and loads every adapter again in name order (vLLM
has no call that empties a slot, and a load activates the adapter), which leaves the last K
adapters in the slots on every worker before every router: the same start for each. Not in
place (`load_inplace`): vLLM 0.32 then reads such an adapter from disk again at every step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.bench.server_launch import KVSERVE, VLLM

ADAPTER_PREFIX = "adapter-"
TENANT_PREFIX = "tenant-"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank
KVSERVE_LOADS = "kvserve:lora_adapter_loads_total"
VLLM_ACTIVATION_LINE = "Activating LoRA. int id:"
LOAD_COUNT_NOTES = {
    KVSERVE: f"adapter loads: the increase of {KVSERVE_LOADS} (copies into a device slot)",
    VLLM: "adapter loads: vLLM 0.32 exports no load counter; counted are its "
            f"'{VLLM_ACTIVATION_LINE}' debug lines (an adapter copied into a slot) in each "
            "worker's log during the run; a worker restarted mid-run adds its startup's "
            "activations",
}

AdapterWriter = Callable[[Path, Path, int, int], Path]
"""(model dir, output dir, rank, seed) -> the PEFT adapter directory written there."""


@dataclass(frozen=True, slots=True)
class FleetAdapters:
    """The N adapters every worker serves (`paths[i]` is `adapter-<i>`'s PEFT directory), K =
    `max_loras` of them in a batch, all of rank `rank`."""

    paths: tuple[Path, ...]
    max_loras: int
    rank: int

    @classmethod
    def write(cls, model_dir: Path, out_dir: Path, num_adapters: int, max_loras: int,
              rank: int, writer: AdapterWriter) -> FleetAdapters:
        """Check the sizes and write `num_adapters` random adapters (seeds 0..N-1) for the model
        in `model_dir` under `out_dir`. ValueError says what to change: a size out of range, or
        a model that cannot take adapters (not a safetensors checkpoint kvserve can adapt)."""
        if num_adapters < 1:
            raise ValueError(f"--adapters {num_adapters}: give at least one adapter")
        if not 1 <= max_loras <= num_adapters:
            raise ValueError(f"--max-loras {max_loras}: must be between 1 and --adapters "
                             f"({num_adapters}); every adapter stays in host memory "
                             "(--max-cpu-loras N), the slots hold K of them")
        if not 1 <= rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"--adapter-rank {rank}: must be between 1 and "
                             f"{VLLM_LORA_RANKS[-1]} (vLLM's largest slot)")
        if not any(model_dir.glob("*.safetensors")):
            raise ValueError(f"--adapters: the model {model_dir} has no safetensors weights, "
                             "so no LoRA adapter can be written for it; use --model tiny, 100m "
                             "or a safetensors checkpoint directory")
        paths = []
        for i in range(num_adapters):
            try:
                paths.append(writer(model_dir, out_dir / f"{ADAPTER_PREFIX}{i}", rank, i))
            except (OSError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"--adapters: cannot write a LoRA adapter for the model "
                                 f"{model_dir} ({type(exc).__name__}: {exc}); kvserve adapts "
                                 "Llama-style checkpoints (q/k/v/o and gate/up/down "
                                 "projections)") from exc
        return cls(tuple(paths), max_loras, rank)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"{ADAPTER_PREFIX}{i}" for i in range(len(self.paths)))

    @property
    def slot_rank(self) -> int:
        """`--max-lora-rank` for every worker: the smallest vLLM accepts that holds `rank`
        (kvserve's workers get the same, so both kinds' slots are alike)."""
        return min(r for r in VLLM_LORA_RANKS if r >= self.rank)

    def worker_args(self) -> tuple[str, ...]:
        """The LoRA flags of every worker, kvserve's and vLLM's alike (module doc)."""
        return ("--enable-lora", "--max-loras", str(self.max_loras),
                "--max-cpu-loras", str(len(self.paths)),
                "--max-lora-rank", str(self.slot_rank), "--lora-modules",
                *(f"{name}={path}" for name, path in zip(self.names, self.paths, strict=True)))

    def adapter_for(self, tenant: str) -> str:
        """`tenant-<t>`'s adapter, `adapter-<t mod N>`; ValueError for another tenant name."""
        index = tenant.removeprefix(TENANT_PREFIX)
        if not tenant.startswith(TENANT_PREFIX) or not index.isdigit():
            raise ValueError(f"tenant {tenant!r}: the adapter map needs the workload's "
                             f"'{TENANT_PREFIX}<number>' names")
        return self.names[int(index) % len(self.paths)]


def kvserve_loads(metrics_text: str) -> float:
    """A kvserve worker's adapter loads so far (`kvserve:lora_adapter_loads_total`, summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               for sample in family.samples if sample.name == KVSERVE_LOADS)


class LogLineCount:
    """Lines containing `marker` in the growing file at `path`, read on from where the last
    call stopped (whole lines only); a `LoadReader` (it ignores the metrics text). A missing
    file counts as empty; the file is appended to, never rewritten (ManagedProcess's logs)."""

    def __init__(self, path: Path, marker: str = VLLM_ACTIVATION_LINE) -> None:
        self.path, self.marker = path, marker.encode()
        self.offset = 0
        self.count = 0

    def __call__(self, _metrics_text: str = "") -> float:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return float(self.count)
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.count += sum(self.marker in line for line in chunk[:end].splitlines())
        self.offset += end
        return float(self.count)


def vllm_worker_env(log_dir: Path) -> tuple[tuple[str, str], ...]:
    """The environment of a vLLM worker serving adapters: a logging config (written into
    `log_dir`) that keeps vLLM's INFO output and turns the LoRA model manager's logger to DEBUG
    (its activations are the count, module doc; it also logs a line per adapted module), and
    the runtime load and unload routes that `reset_vllm_adapters` calls."""
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(filename)s:"
                                           "%(lineno)d] %(message)s",
                                 "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                             "level": "DEBUG", "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                    "vllm.lora.model_manager": {"level": "DEBUG"}}}
    path = log_dir / "vllm-lora-logging.json"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return (("VLLM_LOGGING_CONFIG_PATH", str(path)), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1"))


def reset_vllm_adapters(url: str, adapters: FleetAdapters, base_model: str) -> None:
    """Make a running vLLM worker's slots the same before every router (module doc): unload and
    load each adapter again, in name order (each load a new adapter id, evicting the least
    recently used from host memory and from the slots); then send one base-model token, so the
    worker exports `vllm:lora_requests_info` (it does after its first step) and a gateway
    started next learns its adapters before the load begins. Call before resetting its prefix
    cache.
    httpx.HTTPStatusError when the worker refuses."""
    with httpx.Client(timeout=60.0) as client:
        for name, path in zip(adapters.names, adapters.paths, strict=True):
            client.post(f"{url}/v1/unload_lora_adapter",
                        json={"lora_name": name}).raise_for_status()
            client.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": name, "lora_path": str(path)}).raise_for_status()
        client.post(f"{url}/v1/completions", json={
            "model": base_model, "prompt": "warm", "max_tokens": 1,
        }).raise_for_status()
