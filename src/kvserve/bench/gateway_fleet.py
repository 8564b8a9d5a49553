"""The processes of `kvserve bench gateway`: a fleet of workers and the routers in front of it.

Workers are `LaunchedServer`s (kvserve or vLLM), each with one compute thread and its own core
where the machine has one per worker. Each router configuration starts cold on a fresh fleet:
workers keep running and have their prefix cache reset (`POST /reset_prefix_cache`: vLLM's needs
VLLM_SERVER_DEV_MODE=1, kvserve's the admin key the fleet gives its workers). kvserve workers
are restarted instead (a second or two) where a reset would not give the same cold start: with
LoRA adapters (their slots start empty), or when a worker refuses the reset. A reset worker
publishes AllBlocksCleared at once, so a `precise` router never reads blocks of an earlier
run as cached. With LoRA adapters (gateway_lora.py) every worker
serves them all, and vLLM workers also have their adapter slots reset. Routers are kvserve's
gateway (`kvserve gateway`) or SGLang's router, one or several replicas, each its own process;
"ideal" is no router at all (the clients split by tenant).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from kvserve.bench.gateway_counters import LoadReader
from kvserve.bench.gateway_envoy import ENVOY_EPP, EnvoyEpp
from kvserve.bench.gateway_lora import (
    FleetAdapters,
    LogLineCount,
    kvserve_loads,
    reset_vllm_adapters,
    vllm_worker_env,
)
from kvserve.bench.peers_env import missing_peer_message, sglang_router_binary
from kvserve.bench.server_launch import (
    KVSERVE,
    VLLM,
    LaunchedServer,
    LaunchError,
    LaunchSpec,
    ManagedProcess,
    free_port,
)
from kvserve.gateway.cli.gateway import add_gateway_arguments
from kvserve.gateway.core.pipeline import split_policy_spec

IDEAL = "ideal"
KVSERVE_GATEWAY = "kvserve"
SGLANG_ROUTER = "sglang"
ROUTER_KINDS = (KVSERVE_GATEWAY, SGLANG_ROUTER, ENVOY_EPP)  # ENVOY_EPP: Envoy + `kvserve epp`


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """`kind:policy` (e.g. kvserve:prefix_hash, sglang:cache_aware) or `ideal`; a kvserve
    policy may carry gateway policy options, `kvserve:cache_aware@backlog_weight=0@...` (each
    passed as `--policy-option`), and gateway flags, `kvserve:precise@--queue-timeout=
    0.5` or `kvserve:cache_aware@--no-latency-limit` (passed as given), so variants of one
    policy run side by side."""

    kind: str
    policy: str = ""
    options: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        text = text.strip()
        if text == IDEAL:
            return cls(IDEAL)
        kind, _, rest = text.partition(":")
        policy, *parts = rest.split("@")
        flags = tuple(p for p in parts if p.startswith("--"))  # `--flag` or `--flag=VALUE`
        options = tuple(p for p in parts if not p.startswith("--"))
        split_policy_spec("@".join((policy, *options)))  # a malformed one fails before any process
        if kind not in ROUTER_KINDS or not policy:
            raise ValueError(f"router {text!r}: use 'ideal' or KIND:POLICY with KIND one of "
                             f"{', '.join(ROUTER_KINDS)} (e.g. kvserve:prefix_hash, "
                             "sglang:cache_aware)")
        _check_gateway_flags(text, flags)
        if (options or flags) and kind not in (KVSERVE_GATEWAY, ENVOY_EPP):
            raise ValueError(f"router {text!r}: @KEY=VALUE options and @--flag=VALUE gateway "
                             "flags are for kvserve policies only")
        return cls(kind, policy, options, flags)

    @property
    def label(self) -> str:
        if self.kind == IDEAL:
            return IDEAL
        return "@".join((f"{self.kind}:{self.policy}", *self.options, *self.flags))

    @property
    def keys_text(self) -> bool:
        """Whether a kvserve router keys prompts by characters (so its predicted cached tokens
        are estimates): every policy but `precise`, unless given a tokenizer."""
        return self.policy != "precise" and not any(f.startswith("--tokenizer")
                                                    for f in self.flags)

    @property
    def gateway_args(self) -> list[str]:
        """The `kvserve gateway` arguments for the options and flags."""
        return [*(f"--policy-option={option}" for option in self.options), *self.flags]


def _check_gateway_flags(router: str, flags: Sequence[str]) -> None:
    """Raise ValueError unless `kvserve gateway` accepts `flags` (before any process starts)."""
    if not flags:
        return
    parser = argparse.ArgumentParser(prog="kvserve gateway", exit_on_error=False)
    add_gateway_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(list(flags))
    except argparse.ArgumentError as exc:
        raise ValueError(f"router {router!r}: {exc}") from exc
    if unknown:
        raise ValueError(f"router {router!r}: `kvserve gateway` has no flag {unknown[0]!r}; "
                         "see `kvserve gateway --help`")


BENCH_SALT_SECRET = "kvserve-bench-salt-secret"  # local benchmark fleets only


class KvserveGateway(ManagedProcess):
    """One `kvserve gateway` replica over `workers`."""

    def __init__(self, policy: str, workers: Sequence[str], log_dir: Path,
                 extra_args: Sequence[str] = ()) -> None:
        super().__init__(f"gateway-{policy}", log_dir, startup_timeout_s=60.0)
        self.policy, self.workers, self.extra_args = policy, list(workers), list(extra_args)

    def command(self) -> tuple[list[str], dict[str, str]]:
        # The bench's clients name their tenant in X-Tenant-Id, as an authenticating proxy in
        # front would; every replica salts alike, with a secret the calibration knows too.
        cmd = [sys.executable, "-m", "kvserve.cli", "gateway", "--host", "127.0.0.1",
               "--port", str(self.port), "--policy", self.policy, "--trust-tenant-header",
               "--salt-secret", BENCH_SALT_SECRET, *self.extra_args]
        for url in self.workers:
            cmd += ["--worker", url]
        return cmd, dict(os.environ)


class SglangRouter(ManagedProcess):
    """One SGLang router replica over `workers` (its own /health once workers are registered)."""

    def __init__(self, policy: str, workers: Sequence[str], log_dir: Path) -> None:
        binary = sglang_router_binary()
        if binary is None:  # said before anything starts
            raise LaunchError(missing_peer_message("SGLang's router", "KVSERVE_SGLANG_ROUTER"))
        super().__init__(f"sglang-{policy}", log_dir, startup_timeout_s=60.0)
        self.binary, self.policy, self.workers = binary, policy, list(workers)

    def command(self) -> tuple[list[str], dict[str, str]]:
        return ([str(self.binary), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--policy", self.policy, "--log-level", "warn",
                 "--worker-urls", *self.workers], dict(os.environ))


def gateway_stats(urls: Sequence[str]) -> dict[str, float]:
    """What kvserve gateway replicas say they did (their /metrics, summed): requests by decision
    branch, retries by reason, upstream errors, rejections by reason, deadlines expired by
    stage, latency-limit cuts, the latency and admission limits at the end, how many replicas
    saw other routers on their workers, and the mean time spent before going upstream."""
    from prometheus_client.parser import text_string_to_metric_families

    stats: dict[str, float] = {}
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = None
                if sample.name == "kvserve:gateway_requests_total":
                    key = f"branch:{sample.labels.get('branch')}"
                elif sample.name == "kvserve:gateway_retries_total":
                    key = f"retry:{sample.labels.get('reason')}"
                elif sample.name == "kvserve:gateway_upstream_errors_total":
                    key = "upstream_errors"
                elif sample.name == "kvserve:gateway_rejections_total":
                    key = f"rejected:{sample.labels.get('reason')}"
                elif sample.name == "kvserve:gateway_admission_limit":
                    key = "admission_limit_end"
                elif sample.name == "kvserve:gateway_deadline_expired_total":
                    key = f"deadline:{sample.labels.get('stage')}"
                elif sample.name == "kvserve:gateway_latency_limit_cuts_total":
                    key = "latency_limit_cuts"
                elif sample.name == "kvserve:gateway_latency_limit":
                    key = "latency_limit_end"
                elif sample.name == "kvserve:gateway_resends_total":
                    key = "resends_seen"
                elif sample.name == "kvserve:gateway_shared_workers":
                    key = "replicas_seeing_shared_workers"
                elif sample.name in ("kvserve:gateway_added_latency_seconds_sum",
                                     "kvserve:gateway_added_latency_seconds_count"):
                    key = sample.name.rsplit("_", 1)[1] + "_added_s"
                if key is not None:
                    stats[key] = stats.get(key, 0.0) + sample.value
    if stats.get("count_added_s"):
        stats["added_ms_mean"] = 1000.0 * stats.pop("sum_added_s") / stats.pop("count_added_s")
    return stats


def make_router(spec: RouterSpec, workers: Sequence[str], log_dir: Path,
                gateway_args: Sequence[str] = ()) -> ManagedProcess:
    if spec.kind == KVSERVE_GATEWAY:
        return KvserveGateway(spec.policy, workers, log_dir,
                              [*gateway_args, *spec.gateway_args])
    if spec.kind == SGLANG_ROUTER:
        return SglangRouter(spec.policy, workers, log_dir)
    if spec.kind == ENVOY_EPP:
        return EnvoyEpp(spec.policy, workers, log_dir,
                        ["--salt-secret", BENCH_SALT_SECRET, *gateway_args, *spec.gateway_args])
    raise ValueError(f"{spec.label} is not a router process")


class Fleet:
    """`num_workers` servers of one kind, started once; `fresh()` gives a cold fleet. With
    `adapters`, every worker serves them (gateway_lora.py)."""

    def __init__(self, server: str, spec: LaunchSpec, num_workers: int, log_dir: Path,
                 startup_timeout_s: float, kv_events: bool = False,
                 adapters: FleetAdapters | None = None) -> None:
        if server not in (KVSERVE, VLLM):
            raise ValueError(f"--worker-server {server!r}: choose kvserve or vllm")
        cores = os.cpu_count() or 1
        self.server, self.adapters, self.model = server, adapters, spec.served_model_name
        self._used = False  # whether anything ran on the fleet since `start()` (`fresh`)
        # kvserve's reset is an admin route: a key of this fleet's, where a reset is used.
        self._admin_key = (secrets.token_hex(16) if server == KVSERVE and adapters is None
                           else None)
        if self._admin_key is not None:
            spec = replace(spec, env=spec.env + (("KVSERVE_ADMIN_KEY", self._admin_key),))
        if adapters is not None:
            spec = replace(spec, extra_args=spec.extra_args + adapters.worker_args(),
                           env=spec.env + (vllm_worker_env(log_dir) if server == VLLM else ()))
        # With kv_events, every worker (kvserve or vLLM, the same flag) publishes its KV events
        # on ZMQ, bound on its own ports, and `precise` routers subscribe to them all.
        self._event_ports = [(free_port(), free_port()) for _ in range(num_workers)
                             ] if kv_events else []
        self.workers = [
            LaunchedServer(server, replace(spec, cpus=str(i % cores),
                                           extra_args=spec.extra_args + self._events_flag(i)),
                           log_dir, startup_timeout_s)
            for i in range(num_workers)]
        self.block_size = spec.block_size or (128 if server == VLLM else 16)
        if server == VLLM:
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache

    def _events_flag(self, index: int) -> tuple[str, ...]:
        if not self._event_ports:
            return ()
        pub, replay = self._event_ports[index]
        return ("--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}))

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    def precise_args(self) -> list[str]:
        """What a `precise` gateway needs to follow this fleet: the workers' block size and,
        when they publish on ZMQ, where (each replica subscribes to every worker)."""
        args = [f"--block-size={self.block_size}"]
        for worker, (pub, replay) in zip(self.workers, self._event_ports, strict=False):
            args.append(f"--worker-kv-events={worker.url}=tcp://*:{pub},replay=tcp://*:{replay}"
                        ",topic=kv")
        return args

    def start(self) -> None:
        for w in self.workers:
            w.launch()  # in parallel: each process starts while the others do
        for w in self.workers:
            w.wait_healthy()
        self._used = False

    def fresh(self) -> None:
        """Cold prefix caches on every worker, every worker up; with adapters, the same
        adapter slots before every router (empty on kvserve's, `reset_vllm_adapters` on
        vLLM's). Workers just started and not used yet are cold already: kept as they are
        (kvserve's) or only reset. Used kvserve workers are reset, or restarted where they have
        no key for it (adapters) or one refuses."""
        if self.server == KVSERVE:
            if (not all(w.running for w in self.workers)
                    or (self._used and not self._reset_kvserve())):
                for w in self.workers:
                    w.stop()
                self.start()
            self._used = True
            return
        for w in self.workers:
            if not w.running:
                w.launch()
                w.wait_healthy()
            if self.adapters is not None:
                reset_vllm_adapters(w.url, self.adapters, self.model)
            httpx.post(f"{w.url}/reset_prefix_cache", timeout=30.0).raise_for_status()

    def _reset_kvserve(self) -> bool:
        """Reset every kvserve worker's prefix cache; False where the fleet has no key for it
        or a worker refused (a request still draining): then it is restarted."""
        if self._admin_key is None:
            return False
        headers = {"Authorization": f"Bearer {self._admin_key}"}
        return all(httpx.post(f"{w.url}/reset_prefix_cache", headers=headers,
                              timeout=30.0).status_code == 200 for w in self.workers)

    def load_readers(self) -> list[LoadReader] | None:
        """Per worker, what counts its adapter loads (gateway_lora.py); None without adapters.
        New readers each call: a vLLM one reads its worker's log from the start."""
        if self.adapters is None:
            return None
        if self.server == KVSERVE:
            return [kvserve_loads for _ in self.workers]
        return [LogLineCount(w.log_path) for w in self.workers]

    def kill(self, index: int) -> None:
        self.workers[index].kill()

    def restart(self, index: int) -> None:
        """Start a killed worker again on its port and wait until it is healthy."""
        worker = self.workers[index]
        worker.launch()
        worker.wait_healthy()

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
