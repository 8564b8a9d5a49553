"""Worker URLs as the `ip:port` endpoints Envoy routes to: the protocol names an endpoint in
`x-gateway-destination-endpoint` by IP and port, never by name, and Envoy matches it against
its cluster's addresses. Each `--worker` URL is checked and its host resolved once, at
start."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

Resolve = Callable[[str, int], str]


def resolve_ipv4_first(host: str, port: int) -> str:
    """The host's first address, IPv4 preferred; raises ValueError when it has none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc.strerror}") from None
    addresses = [str(info[4][0]) for info in infos]
    v4 = [a for a in addresses if ":" not in a]
    return (v4 or addresses)[0]


def endpoint_of(host: str, port: int) -> str:
    """`ip:port`, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class Endpoints:
    """Worker URL <-> `ip:port`, both ways; `resolved` lists the names that were looked up
    (`name -> ip`), to be told to the operator. A worker discovered later (`--worker-dns`,
    `--workers-file`) is mapped when first named, its host resolved once."""

    by_url: dict[str, str]
    by_endpoint: dict[str, str]
    resolved: dict[str, str]
    resolve: Resolve = resolve_ipv4_first

    def endpoint_of(self, url: str) -> str:
        """The `ip:port` Envoy is told for the worker at `url`."""
        found = self.by_url.get(url)
        if found is None:
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or 80
            try:
                ip = str(ipaddress.ip_address(host))
            except ValueError:
                ip = self.resolve(host, port)
                self.resolved[host] = ip
            found = self.by_url[url] = endpoint_of(ip, port)
            self.by_endpoint.setdefault(found, url)
        return found

    def url_of(self, endpoint: str) -> str:
        """The worker URL of an `ip:port` (a discovered worker's, when not mapped yet)."""
        return self.by_endpoint.get(endpoint) or f"http://{endpoint}"

    @classmethod
    def from_urls(cls, urls: list[str], resolve: Resolve = resolve_ipv4_first) -> Endpoints:
        """Raises ValueError naming the URL and what to write instead."""
        by_url: dict[str, str] = {}
        resolved: dict[str, str] = {}
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.path.strip("/") \
                    or parts.query:
                raise ValueError(f"--worker {url!r} is not http://HOST:PORT: the Endpoint "
                                 "Picker names a worker to Envoy by address and port only "
                                 "(plain HTTP, no path), e.g. --worker http://10.0.0.7:8000")
            try:
                port = parts.port
            except ValueError:
                port = None
            if port is None:
                raise ValueError(f"--worker {url!r} gives no port: Envoy is told each "
                                 "endpoint as ip:port, so write it, e.g. http://10.0.0.7:8000")
            host = parts.hostname
            try:
                ip = str(ipaddress.ip_address(host))
            except ValueError:
                ip = resolve(host, port)
                resolved[host] = ip
            endpoint = endpoint_of(ip, port)
            if endpoint in {v for v in by_url.values()}:
                raise ValueError(f"--worker {url!r} is {endpoint}, which another --worker "
                                 "already names: give each worker once")
            by_url[url.rstrip("/")] = endpoint
        return cls(by_url, {e: u for u, e in by_url.items()}, resolved, resolve)

    def urls(self, endpoints: list[str]) -> set[str]:
        """The worker URLs `endpoints` name (the pool decides which are its own)."""
        return {self.url_of(e) for e in endpoints}
