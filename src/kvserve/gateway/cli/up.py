"""`kvserve up`: N local kvserve workers and a gateway in front, one command; stopping it
(SIGINT or SIGTERM) stops the workers."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx
import uvicorn
from rich.console import Console

from kvserve.gateway.cli.gateway import (
    add_admin_key_argument,
    add_gateway_arguments,
    settings_from_args,
)
from kvserve.gateway.core.pipeline import make_policy, parse_policy_options
from kvserve.gateway.proxy.app import create_gateway


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    u = sub.add_parser("up", help="N local kvserve workers and the gateway, one command")
    u.add_argument("--workers", type=int, default=2, help="number of local workers")
    u.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated: this many --role prefill workers (with "
                        "--decode-workers; replaces --workers)")
    u.add_argument("--decode-workers", type=int, default=0,
                   help="disaggregated: this many --role decode workers")
    u.add_argument("--decode-host-tier-bytes", type=int, default=256 << 20,
                   help="host KV tier of each decode worker, which receives the KV")
    u.add_argument("--model", default=None,
                   help="GGUF file, HF id or local path (default: SmolLM2-135M-Instruct)")
    u.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for each `kvserve serve` (repeatable)")
    add_gateway_arguments(u)
    add_admin_key_argument(u)
    u.set_defaults(func=run_up)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_up(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    disaggregated = bool(args.prefill_workers or args.decode_workers)
    if disaggregated and min(args.prefill_workers, args.decode_workers) < 1:
        console.print("[red]--prefill-workers and --decode-workers go together, each >= 1[/]")
        return 2
    if not disaggregated and args.workers < 1:
        console.print("[red]--workers must be at least 1[/]")
        return 2
    try:  # bad options are refused before any worker starts
        make_policy(args.policy, **parse_policy_options(args.policy_option))
    except ValueError as exc:
        console.print(f"[red]cannot start: {exc}[/]", soft_wrap=True)
        return 2
    roles = (["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
             if disaggregated else ["both"] * args.workers)
    # Keys shared by these workers and this gateway only, handed over in the environment (not
    # argv, which every local user can read): the admin key for KV transfers, the salt key so
    # that only this gateway's salts reach the workers' caches.
    if disaggregated and not args.admin_key:
        args.admin_key = secrets.token_hex(16)
    if not args.trusted_salt_key:
        args.trusted_salt_key = secrets.token_hex(16)
    worker_env = dict(os.environ, KVSERVE_TRUSTED_SALT_KEY=args.trusted_salt_key)
    if args.admin_key:
        worker_env["KVSERVE_ADMIN_KEY"] = args.admin_key
    ports = [free_port() for _ in roles]
    threads = max(1, (os.cpu_count() or 1) // len(roles))
    # SIGTERM (systemd, Kubernetes, `kill`) must stop the workers too. uvicorn shuts down on it
    # and then raises it again with the handler it found; with the default one, that killed
    # this process before the `finally` below, leaving every worker running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    procs = []
    for port, role in zip(ports, roles, strict=True):
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
               "--num-threads", str(threads), "--role", role, *args.worker_arg,
               "--behind-gateway", f"http://{args.host}:{args.port}"]
        if role == "decode":
            cmd += ["--kv-host-tier-bytes", str(args.decode_host_tier_bytes)]
        if args.model:
            cmd += ["--model", args.model]
        if args.policy == "precise" and role != "decode":
            cmd += ["--kv-events-config", _follow_kv_events(args, f"http://127.0.0.1:{port}")]
        procs.append(subprocess.Popen(cmd, env=worker_env))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    by_role = {r: [u for u, ur in zip(urls, roles, strict=True) if ur == r]
               for r in ("both", "prefill", "decode")}
    try:
        with console.status(f"starting {len(roles)} workers …"):
            _wait_healthy(urls, procs, timeout_s=300)
        app = create_gateway(settings_from_args(args, by_role["both"], by_role["prefill"],
                                                by_role["decode"]))
        gateway_url = f"http://{args.host}:{args.port}"
        console.print(f"[green]kvserve up[/]: gateway ({args.policy}) at [bold]{gateway_url}"
                      f"[/] → {', '.join(urls)}", soft_wrap=True)
        console.print(f"try: curl {gateway_url}/v1/completions -H 'Content-Type: "
                      "application/json' -d '{\"prompt\": \"Hello\", "
                      "\"max_tokens\": 16}'", soft_wrap=True, highlight=False)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/]", soft_wrap=True)
        return 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def _follow_kv_events(args: argparse.Namespace, url: str) -> str:
    """The worker's `--kv-events-config`, and the gateway's matching `--worker-kv-events` added
    to `args`: on loopback only (the events carry prompt tokens), the worker connecting to a
    port the one gateway binds, its replay endpoint bound on a port of its own."""
    pub, replay = free_port(), free_port()
    args.worker_kv_events = [*getattr(args, "worker_kv_events", []),
                             f"{url}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay}"]
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{pub}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}"})


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]],
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        for url, proc in zip(urls, procs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {url} exited with {proc.returncode}")
            if url in pending:
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not healthy after {timeout_s:.0f}s: {sorted(pending)}")
        time.sleep(0.2)
