"""The KV-event publisher's configuration, in vLLM's `--kv-events-config` JSON shape, and the
endpoint rules both ends follow.

A publisher binds an endpoint with a wildcard host (`tcp://*:5557`), and ipc/inproc ones; it
connects to a `tcp://host:port` one, so there the subscriber binds. The replay endpoint (a
ROUTER answering "everything from seq N") is always bound by the publisher. Data-parallel rank r
publishes on the endpoint's port + r (a tcp port 0 is left to the OS; inproc gets `_dp<r>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Self

DEFAULT_ENDPOINT = "tcp://*:5557"
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """What `--kv-events-config` says (vLLM's field names; unknown ones are refused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    topic: str = ""

    @property
    def is_enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Parse the flag's JSON; ValueError naming the bad field and the valid ones."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object, e.g. "
                             '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                             '"endpoint": "tcp://*:5557"}\'')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(known))}")
        enabled = raw.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        publisher = raw.get("publisher", "zmq" if enabled else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got "
                             f"{publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = raw.get(name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1, got "
                                 f"{value!r}")
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = raw.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        config = cls(**{**raw, "publisher": publisher})
        for endpoint in (config.endpoint, config.replay_endpoint):
            if endpoint is not None:
                check_endpoint(endpoint)
        return config


def check_endpoint(endpoint: str) -> None:
    """ValueError unless `endpoint` is a tcp://host:port, ipc:// or inproc:// address."""
    if endpoint.startswith(("ipc://", "inproc://")) and len(endpoint.split("://", 1)[1]) > 0:
        return
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit() and int(port) < 65536:
            return
    raise ValueError(f"KV-event endpoint {endpoint!r}: expected tcp://HOST:PORT, "
                     "tcp://*:PORT, ipc://PATH or inproc://NAME")


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether the publisher binds this endpoint (wildcard host, ipc, inproc) or connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` uses (see the module doc)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(f"data-parallel ranks need a tcp:// or inproc:// endpoint, got {endpoint!r}")


def subscriber_address(endpoint: str, worker_host: str) -> tuple[str, bool]:
    """Where a subscriber of a publisher configured with `endpoint` attaches, and whether it
    binds there: it binds what the publisher connects to, and connects to what it binds (a
    wildcard host then means the worker's own host)."""
    if is_bind_endpoint(endpoint):
        if endpoint.startswith("tcp://"):
            port = endpoint.rpartition(":")[2]
            host = f"[{worker_host}]" if ":" in worker_host else worker_host
            return f"tcp://{host}:{port}", False
        return endpoint, False
    return endpoint, True
