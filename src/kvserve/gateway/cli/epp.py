"""`kvserve epp`: the Endpoint Picker for Envoy, with the same routing, admission and tenancy
flags as `kvserve gateway`; `--print-envoy-config` prints the Envoy bootstrap to run in front."""

from __future__ import annotations

import argparse
import asyncio

from rich.console import Console

from kvserve.gateway.cli.gateway import (
    add_discovery_arguments,
    add_gateway_arguments,
    settings_from_args,
)
from kvserve.gateway.core.seniority import Seniority
from kvserve.gateway.epp.endpoints import Endpoints
from kvserve.gateway.epp.envoy_config import BODY_MODES, EnvoyConfig
from kvserve.gateway.fleet.build import build_fleet
from kvserve.gateway.fleet.discovery import DnsName

DEFAULT_GRPC_PORT = 9002


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("epp", help="the Endpoint Picker (Envoy ext_proc) in front of "
                       "OpenAI-compatible workers, routed like `kvserve gateway`")
    e.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker as http://IP:PORT (repeatable; a host name is resolved once, "
                        "at start, since Envoy connects to the address it is given)")
    e.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                   help="the ext_proc and gRPC health port (--port serves /metrics, /health)")
    e.add_argument("--print-envoy-config", action="store_true",
                   help="print an Envoy bootstrap YAML that runs this picker in front of the "
                        "workers, and exit")
    e.add_argument("--listen-port", type=int, default=10000,
                   help="with --print-envoy-config: the port Envoy serves clients on")
    e.add_argument("--listen-host", default="0.0.0.0",
                   help="with --print-envoy-config: the address Envoy serves clients on")
    e.add_argument("--envoy-admin-port", type=int, default=9901,
                   help="with --print-envoy-config: Envoy's admin port")
    e.add_argument("--envoy-body-mode", choices=BODY_MODES, default=BODY_MODES[0],
                   help="with --print-envoy-config: how Envoy sends request bodies to the "
                        "picker (FULL_DUPLEX_STREAMED, as llm-d; or BUFFERED)")
    add_discovery_arguments(e)
    add_gateway_arguments(e)
    e.set_defaults(func=run_epp)


def run_epp(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.print_envoy_config:
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        if args.workers_file:
            console.print("[red]--print-envoy-config lists the workers in Envoy's cluster: give "
                          "them as --worker or --worker-dns (a --workers-file is read by the "
                          "picker alone)[/]", soft_wrap=True)
            return 2
        try:
            endpoints = Endpoints.from_urls(args.worker)
            dns = tuple(DnsName.from_spec(spec) for spec in args.worker_dns)
            print(EnvoyConfig(workers=tuple(endpoints.by_url.values()),
                              dns_names=tuple(f"{d.host}:{d.port}" for d in dns),
                              dns_refresh_s=args.discovery_interval,
                listen_port=args.listen_port, epp_port=args.grpc_port,
                admin_port=args.envoy_admin_port, listen_host=args.listen_host, epp_host=host,
                body_mode=args.envoy_body_mode,
                queue_wait_s=max(args.queue_timeout, args.max_queue_wait),
                num_retries=3 if dns else max(1, len(args.worker) - 1)).render(), end="")
        except ValueError as exc:
            console.print(f"[red]{exc}[/]", soft_wrap=True)
            return 2
        return 0
    if not (args.worker or args.worker_dns or args.workers_file):
        console.print("[red]give --worker http://IP:PORT (repeatable), --worker-dns NAME:PORT "
                      "or --workers-file PATH[/]", soft_wrap=True)
        return 2
    try:
        endpoints = Endpoints.from_urls(args.worker)
        settings = settings_from_args(args, list(endpoints.by_url))
        fleet = build_fleet(settings)
    except ValueError as exc:
        console.print(f"[red]cannot start: {exc}[/]", soft_wrap=True)
        return 2
    for name, ip in endpoints.resolved.items():
        console.print(f"kvserve epp: resolved {name} to {ip} (Envoy connects to addresses; "
                      "restart the picker if it moves)", soft_wrap=True)
    # The protobufs and grpc load only for a running picker, not for every `kvserve` command.
    from kvserve.gateway.epp.exchange import Picker
    from kvserve.gateway.epp.server import serve

    picker = Picker(fleet, endpoints, settings.tenancy, settings.max_body_bytes,
                    settings.ttft_target_s, Seniority() if settings.seniority else None,
                    settings.worker_api_key, settings.trusted_salt_key)
    console.print(f"[green]kvserve epp[/] ({args.policy}): ext_proc on {args.host}:"
                  f"{args.grpc_port}, /metrics on http://{args.host}:{args.port} → "
                  f"{', '.join(endpoints.by_url.values())}"
                  + "".join(f" + DNS {name}" for name in args.worker_dns)
                  + (f" + file {args.workers_file}" if args.workers_file else ""),
                  soft_wrap=True)
    try:
        asyncio.run(serve(picker, args.host, args.grpc_port, args.port, settings.metrics_key))
    except OSError as exc:
        console.print(f"[red]cannot start: {exc}[/]", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        pass
    return 0

