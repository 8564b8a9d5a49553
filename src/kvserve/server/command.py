"""`kvserve serve`: one OpenAI-compatible worker."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from typing import TYPE_CHECKING

from rich.console import Console

from kvserve.server.settings import ServerSettings, WorkerRole
from kvserve.server.tool_flags import ToolSettings, add_tool_arguments, check_tool_arguments

if TYPE_CHECKING:  # torch and the engine load only for `serve` itself, not for every command
    from kvserve.runtime import EngineArgs


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine sizing flags, named as in vLLM."""
    p.add_argument("--model", default=None,
                   help="HF model id or local directory (default: the built-in demo model, "
                        "random weights, meaningless text, no download)")
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
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn the prefix cache off")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit-interval-steps", type=int, default=0,
                   help="run the full KV cache audit every N steps (0: only when idle)")
    p.add_argument("--idle-audit-interval-s", type=float, default=60.0,
                   help="the idle check runs on every drain; the full audit on a drain at most "
                        "once per this many seconds (0: on every drain)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    from kvserve.runtime import EngineArgs

    return EngineArgs(
        model=args.model, served_model_name=args.served_model_name, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_host_tier_bytes=args.kv_host_tier_bytes, kv_disk_tier_bytes=args.kv_disk_tier_bytes,
        kv_disk_tier_path=args.kv_disk_tier_path, preemption_mode=args.preemption_mode,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype, device=args.device, seed=args.seed,
        audit_interval_steps=args.audit_interval_steps,
        idle_audit_interval_s=args.idle_audit_interval_s, num_threads=args.num_threads,
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run one OpenAI-compatible worker")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require this key on /v1 routes (env KVSERVE_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ADMIN_KEY"),
                   help="key for /debug routes (default: the API key)")
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
    add_tool_arguments(p)
    p.set_defaults(func=run)


def check_role(args: argparse.Namespace) -> None:
    """Refuse a role without what it needs (ValueError saying how to fix it)."""
    role = WorkerRole(args.role)
    if role is WorkerRole.BOTH:
        return
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
    from kvserve.server.app import create_app

    console = Console(stderr=True)
    try:
        check_role(args)
        check_tool_arguments(args)
        engine_args = engine_args_from(args)
        with console.status(f"loading {args.model or 'the built-in demo model'} …"):
            engine = LLMEngine.from_args(engine_args)
    except (ValueError, OSError) as exc:
        console.print(f"[red]cannot start: {exc}[/]", soft_wrap=True)
        return 2
    settings = ServerSettings(
        api_key=args.api_key, admin_key=args.admin_key,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout or None, drain_timeout_s=args.drain_timeout,
        role=WorkerRole(args.role), kv_transfer_timeout_s=args.kv_transfer_timeout,
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
    )
    app = create_app(AsyncEngine(engine), settings)
    # This process serves one engine for its whole life: freeze what start-up built (the block
    # pool's num_blocks objects, the model's modules) so full collections stop walking it again
    # and again, which paused steps for hundreds of milliseconds. (Not done in LLMEngine: a
    # library engine can be dropped, and frozen cycles would never be collected.)
    gc.collect()
    gc.freeze()
    url = f"http://{args.host}:{args.port}"
    stats = engine.kv_cache.stats()
    console.print(f"[green]kvserve[/] serving [bold]{engine.model_name}[/] at {url} "
                  f"({stats.num_blocks} KV blocks of {stats.block_size} tokens, role "
                  f"{args.role})", soft_wrap=True)
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    console.print(f"try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
                  f"-d '{{\"model\": \"{engine.model_name}\", \"prompt\": \"Hello\", "
                  f"\"max_tokens\": 16}}'", soft_wrap=True, highlight=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per KV pull
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=int(args.drain_timeout) + 1)
    return 0
