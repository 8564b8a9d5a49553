"""`kvserve gateway` (route to --worker URLs) and the flags it shares with `kvserve up` and
`kvserve epp`."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn
from rich.console import Console

from kvserve.gateway.core.adapters import parse_tenant_adapters
from kvserve.gateway.core.pipeline import POLICY_NAMES, parse_policy_options
from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from kvserve.gateway.core.tenancy import Tenancy, generated_secret
from kvserve.gateway.fleet.discovery import DEFAULT_INTERVAL_S
from kvserve.gateway.fleet.kv_event_source import EventSource
from kvserve.gateway.proxy.app import GatewaySettings, create_gateway

log = logging.getLogger(__name__)


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    """The routing and admission flags `kvserve gateway` and `kvserve up` share."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    # cache_aware keeps the ideal split's hit rate with one gateway and behind replicas, where
    # prefix_hash's split of a few tenants can be uneven and precise costs more CPU
    # (docs/benchmarks.md, "Gateway").
    p.add_argument("--policy", choices=POLICY_NAMES, default="cache_aware")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword option of the policy (repeatable), e.g. backlog_weight=0.5 "
                        "for cache_aware/precise; an unknown key names the valid ones")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests open upstream at once, fleet-wide; once every worker has "
                        "been seen full, at most their batch capacity plus a quarter")
    p.add_argument("--max-queued", type=int, default=512, help="requests waiting for a slot")
    p.add_argument("--queue-timeout", type=float, default=1.0,
                   help="seconds a request whose client does not say its timeout may wait "
                        "for a slot before 429 + Retry-After (below the clients' own "
                        "timeouts, so they back off, not resend)")
    p.add_argument("--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S, metavar="S",
                   help="a client that says its timeout (x-stainless-read-timeout, as the "
                        "OpenAI SDKs send it; x-kvserve-timeout; Envoy's) waits for a slot "
                        "while it can still be answered in time (its time left less the "
                        "recent time from admission to a first byte), and at most S "
                        "seconds, before 429 + Retry-After")
    p.add_argument("--latency-limit", action=argparse.BooleanOptionalAction, default=True,
                   help="also limit requests in flight by whether they start answering in "
                        "time (AIMD: cut when a first byte is late or a client leaves before "
                        "it); a late first byte is one past 3/4 of the client's timeout "
                        "(x-kvserve-timeout, x-stainless-read-timeout) or --ttft-target. It "
                        "applies while some worker does not declare its batch (vLLM, SGLang), "
                        "or always with --ttft-target")
    p.add_argument("--seniority", action=argparse.BooleanOptionalAction, default=True,
                   help="queue a client's resend of a request not yet answered (same tenant, "
                        "path and body) in the place its first send took, ahead of younger "
                        "requests, instead of at the back")
    p.add_argument("--ttft-target", type=float, default=None, metavar="S",
                   help="a first byte later than S seconds is late, whatever the client said")
    p.add_argument("--retry-ratio", type=float, default=0.1,
                   help="retries may add at most this fraction of the request rate")
    p.add_argument("--tenant-header", default="X-Tenant-Id",
                   help="the header --trust-tenant-header reads the tenant from")
    p.add_argument("--trust-tenant-header", action="store_true",
                   help="take the tenant from --tenant-header: only behind an authenticating "
                        "layer that sets it and strips clients' own (docs/operations.md); "
                        "otherwise a client could claim another tenant's cache")
    p.add_argument("--api-keys-file", default=os.environ.get("KVSERVE_API_KEYS_FILE"),
                   metavar="FILE", help="'TENANT KEY' lines: the gateway checks clients' API "
                   "keys (401 otherwise) and the key decides the tenant (env "
                   "KVSERVE_API_KEYS_FILE)")
    p.add_argument("--worker-api-key", default=os.environ.get("KVSERVE_WORKER_API_KEY"),
                   help="with --api-keys-file: the key sent to workers started with --api-key "
                        "(clients' keys are never forwarded then; env KVSERVE_WORKER_API_KEY)")
    p.add_argument("--share-group", action="append", default=[], metavar="TENANT=GROUP",
                   help="tenants in one group share prefix blocks (repeatable)")
    p.add_argument("--tenant-adapter", action="append", default=[], metavar="TENANT=ADAPTER",
                   help="serve TENANT's requests with the LoRA adapter ADAPTER (its name as "
                        "the workers list it; repeatable): the gateway sends it as the "
                        "request's model and routes by where it is loaded. A request whose "
                        "model names an adapter a worker lists runs under that one")
    p.add_argument("--salt-secret", default=os.environ.get("KVSERVE_SALT_SECRET"),
                   help="keys tenants' cache salts (env KVSERVE_SALT_SECRET; >= 16 characters). "
                        "Without it one gateway makes a random one (salts change on restart); "
                        "--replicas > 1 needs the same secret on every replica")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="gateway replicas routing to these workers (> 1 needs --salt-secret)")
    p.add_argument("--trusted-salt-key", default=os.environ.get("KVSERVE_TRUSTED_SALT_KEY"),
                   help="sent with every salted request as X-KVServe-Salt-Key, for workers "
                        "started with the same --trusted-salt-key (env "
                        "KVSERVE_TRUSTED_SALT_KEY)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the workers' model directory (or tokenizer.json): exact token keys for "
                        "--policy precise (default: the first worker's /v1/models root, when "
                        "it is a local directory)")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size")
    p.add_argument("--metrics-key", default=os.environ.get("KVSERVE_METRICS_KEY"),
                   help="required on this gateway's /metrics and sent to the workers' (start "
                        "them with the same --metrics-key; env KVSERVE_METRICS_KEY)")


def add_admin_key_argument(p: argparse.ArgumentParser) -> None:
    """`--admin-key`, for the commands that route disaggregated (`gateway`, `up`); the
    Endpoint Picker does not, so it has none."""
    p.add_argument("--admin-key", default=os.environ.get("KVSERVE_ADMIN_KEY"),
                   help="disaggregated mode: the workers' admin key, sent to decode workers "
                        "so they pull a prompt's KV from a prefill worker (env "
                        "KVSERVE_ADMIN_KEY)")


def add_discovery_arguments(p: argparse.ArgumentParser) -> None:
    """Workers found without a restart, for `kvserve gateway` and `kvserve epp` alike."""
    p.add_argument("--worker-dns", action="append", default=[], metavar="NAME:PORT",
                   help="workers by DNS (repeatable): every A/AAAA address of NAME is a worker "
                        "http://IP:PORT (a Kubernetes headless Service), re-resolved every "
                        "--discovery-interval; a failed lookup keeps the last known addresses")
    p.add_argument("--workers-file", default=None, metavar="PATH",
                   help="workers from a file, one URL per line ('#' comments), re-read when it "
                        "changes (a mounted ConfigMap); a bad version keeps the last good one. "
                        "With --worker and --worker-dns the fleet is the union; a worker that "
                        "leaves finishes its requests in flight and gets no new one. For "
                        "--policy precise, give the port every worker publishes its KV events "
                        "on: --worker-kv-events tcp://*:PORT[,replay=tcp://*:PORT]")
    p.add_argument("--discovery-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help="seconds between two reads of --worker-dns and --workers-file")
    p.add_argument("--worker-kv-events", action="append", default=[],
                   metavar="[URL=]ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N]",
                   help="`precise`: follow workers' KV events over ZMQ (vLLM's "
                        "--kv-events-config, or kvserve's), ENDPOINT as the worker was given "
                        "it: tcp://*:PORT (the worker binds; the gateway connects to the "
                        "worker's host) or tcp://HOST:PORT (the worker connects; the gateway "
                        "binds it, so only one gateway can). With URL=, that worker's; "
                        "without, every worker's not named, discovered ones included (one "
                        "Deployment's pods share one config: tcp://*:5557,replay=tcp://*:5558)."
                        " Repeatable. A worker with none publishes nothing to the gateway: a "
                        "warning names it")


def tenancy_from(args: argparse.Namespace) -> Tenancy:
    """The tenancy the flags ask for; a gateway given no salt secret makes one (and says so)
    unless it is one of several replicas, which must agree. Raises ValueError saying what to
    fix."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    secret = args.salt_secret
    if secret is None:
        if args.replicas > 1:
            raise ValueError(f"--replicas {args.replicas}: every replica must salt a tenant "
                             "alike, so give them one --salt-secret (or KVSERVE_SALT_SECRET), "
                             "e.g. from `openssl rand -hex 32`")
        secret = generated_secret()
        log.warning("kvserve gateway: no --salt-secret given; using a random one, so tenants' "
                    "salts (and cached prefixes) start anew when this gateway restarts")
    if args.worker_api_key and not args.api_keys_file:
        raise ValueError("--worker-api-key replaces clients' keys, which the gateway checks "
                         "only with --api-keys-file: give both, or neither (clients' keys are "
                         "then forwarded to the workers)")
    return Tenancy.from_options(secret, args.share_group, args.api_keys_file,
                                args.trust_tenant_header, args.tenant_header)


def settings_from_args(args: argparse.Namespace, workers: list[str],
                       prefill: list[str] | None = None,
                       decode: list[str] | None = None) -> GatewaySettings:
    """The settings the shared flags give; raises ValueError naming a flag out of range."""
    if args.ttft_target is not None and not args.ttft_target > 0:
        raise ValueError(f"--ttft-target must be a positive number of seconds, got "
                         f"{args.ttft_target}")
    for flag, value in (("--queue-timeout", args.queue_timeout),
                        ("--max-queue-wait", args.max_queue_wait)):
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"{flag} must be a number of seconds >= 0, got {value}")
    sources = [EventSource.parse(spec) for spec in getattr(args, "worker_kv_events", [])]
    defaults = [source for url, source in sources if url is None]
    if len(defaults) > 1:
        raise ValueError("--worker-kv-events without URL= is every worker's source: give it "
                         "once (name the others' URL=)")
    prefill_urls = tuple(w.rstrip("/") for w in prefill or ())
    decode_urls = tuple(w.rstrip("/") for w in decode or ())
    return GatewaySettings(
        workers=tuple(w.rstrip("/") for w in workers) + prefill_urls + decode_urls,
        prefill_workers=prefill_urls, decode_workers=decode_urls, policy=args.policy,
        policy_options=tuple(parse_policy_options(args.policy_option).items()),
        max_in_flight=args.max_in_flight, max_queued=args.max_queued,
        queue_timeout_s=args.queue_timeout, max_queue_wait_s=args.max_queue_wait,
        retry_ratio=args.retry_ratio,
        latency_limit=args.latency_limit, ttft_target_s=args.ttft_target,
        seniority=args.seniority,
        tenancy=tenancy_from(args), worker_api_key=args.worker_api_key,
        tenant_adapters=tuple(parse_tenant_adapters(args.tenant_adapter).items()),
        trusted_salt_key=args.trusted_salt_key, metrics_key=args.metrics_key,
        tokenizer=args.tokenizer, block_size=args.block_size,
        admin_key=getattr(args, "admin_key", None),
        worker_kv_events=tuple((url, source) for url, source in sources if url is not None),
        kv_events_default=defaults[0] if defaults else None,
        worker_dns=tuple(getattr(args, "worker_dns", [])),
        workers_file=getattr(args, "workers_file", None),
        discovery_interval_s=getattr(args, "discovery_interval", DEFAULT_INTERVAL_S),
    )


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("gateway", help="cache-aware gateway in front of OpenAI-compatible workers")
    g.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL (repeatable): kvserve, vLLM or SGLang")
    add_discovery_arguments(g)
    g.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                   help="disaggregated mode: a `kvserve serve --role prefill` worker "
                        "(repeatable; chosen by --policy); needs --decode-worker, --admin-key")
    g.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                   help="disaggregated mode: a `kvserve serve --role decode` worker "
                        "(repeatable; chosen by least load)")
    add_admin_key_argument(g)
    add_gateway_arguments(g)
    g.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    if not (args.worker or args.worker_dns or args.workers_file or args.prefill_worker
            or args.decode_worker):
        Console(stderr=True).print("[red]give --worker URL (repeatable), --worker-dns "
                                   "NAME:PORT or --workers-file PATH, or --prefill-worker "
                                   "and --decode-worker URLs for disaggregated mode[/]")
        return 2
    try:
        app = create_gateway(settings_from_args(args, args.worker, args.prefill_worker,
                                       args.decode_worker))
    except ValueError as exc:
        Console(stderr=True).print(f"[red]cannot start: {exc}[/]", soft_wrap=True)
        return 2
    Console(stderr=True).print(f"[green]kvserve gateway[/] ({args.policy}) at "
                               f"http://{args.host}:{args.port} → "
                               f"{', '.join(args.worker + args.prefill_worker)}"
                               + "".join(f" + DNS {name}" for name in args.worker_dns)
                               + (f" + file {args.workers_file}" if args.workers_file else "")
                               + (f" (decode: {', '.join(args.decode_worker)})"
                                  if args.decode_worker else ""),
                               soft_wrap=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
