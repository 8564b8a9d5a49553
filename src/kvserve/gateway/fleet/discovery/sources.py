"""The pure part of worker discovery: what a workers file and a DNS answer say the fleet is,
and how a discovered fleet differs from the current one. No I/O, no clock: the watcher
(`watch.py`) reads the file and asks the resolver, and hands the results here."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit


class WorkersFileError(ValueError):
    """A workers file that cannot be used as it is; the message names the file, the line and
    what a line must look like."""


@dataclass(frozen=True, slots=True)
class DnsName:
    """One `--worker-dns NAME:PORT`: every A/AAAA address of `host` is a worker at `port`
    (a Kubernetes headless Service answers with its ready pods' addresses)."""

    host: str
    port: int

    @classmethod
    def from_spec(cls, spec: str) -> DnsName:
        """Parse NAME:PORT. Raises ValueError saying what to write instead."""
        host, sep, port = spec.strip().rpartition(":")
        how = ("give --worker-dns NAME:PORT, e.g. kvserve-worker.default.svc.cluster.local:8000 "
               "(a headless Service and the workers' port)")
        if not sep or not host or "/" in spec or not port.isdigit():
            raise ValueError(f"--worker-dns {spec!r}: {how}")
        if not 0 < int(port) < 65536:
            raise ValueError(f"--worker-dns {spec!r}: port {port} is not in 1-65535; {how}")
        return cls(host.removeprefix("[").removesuffix("]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def worker_urls(addresses: list[str], port: int) -> frozenset[str]:
    """The workers a DNS answer names: `http://IP:PORT` per distinct address (IPv6 in
    brackets). An address that is not an IP (a resolver's oddity) is skipped."""
    urls = set()
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
        except ValueError:
            continue
        host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
        urls.add(f"http://{host}:{port}")
    return frozenset(urls)


def normalize_worker_url(url: str) -> str:
    """A worker's base URL as the pool keys it (no trailing slash). Raises ValueError unless it
    is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not a worker URL: write http://HOST:PORT (or https://)")
    try:
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ValueError(f"{url!r} has a bad port ({exc}): write http://HOST:PORT") from None
    return url.rstrip("/")


def parse_workers_file(text: str, path: str) -> frozenset[str]:
    """The workers a workers file lists: one URL per line; `#` starts a comment, blank lines
    are skipped. Raises WorkersFileError naming the first bad line."""
    urls = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            urls.add(normalize_worker_url(line))
        except ValueError as exc:
            raise WorkersFileError(f"{path}:{number}: {exc}; one worker URL per line, '#' "
                                   "comments") from None
    return frozenset(urls)


@dataclass(frozen=True, slots=True)
class FileSignature:
    """What tells a changed file from the same one: device, inode, size and mtime of the path,
    symlinks followed (a mounted ConfigMap is updated by swapping a symlink, which changes the
    inode even when size and mtime look alike)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> FileSignature:
        """Raises OSError when the path (or a link's target) is missing."""
        st = os.stat(path)  # follows symlinks
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class FleetChange:
    """How a discovered fleet differs from the current one (both sorted)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def fleet_change(current: set[str] | frozenset[str],
                 discovered: set[str] | frozenset[str]) -> FleetChange:
    """The workers to add (discovered, not current) and to remove (current, not
    discovered)."""
    return FleetChange(tuple(sorted(discovered - current)), tuple(sorted(current - discovered)))
