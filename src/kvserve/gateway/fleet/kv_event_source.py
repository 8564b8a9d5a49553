"""Where a worker publishes its KV events, as `--worker-kv-events` says: per worker
(`URL=ENDPOINT...`, any endpoint the worker was given) or for every worker not named
(`ENDPOINT...`, a port each worker binds: the workers of one Kubernetes Deployment share one
`--kv-events-config`, and discovered workers are found by that convention)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvevents.config import check_endpoint, is_bind_endpoint


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker publishes: its `--kv-events-config` endpoint and replay endpoint as the
    worker was given them, its topic and its number of data-parallel ranks."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int = 1

    @classmethod
    def parse(cls, spec: str) -> tuple[str | None, EventSource]:
        """`URL=ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N]` (the flag's form) -> (url, source);
        without `URL=`, the source of every worker not named (url None): each worker binds
        the same `tcp://*:PORT`, as the pods of one Deployment do. ValueError saying the
        expected form."""
        form = ("expected [URL=]ENDPOINT[,replay=ENDPOINT][,topic=T][,dp=N], e.g. "
                "http://10.0.0.5:8000=tcp://*:5557,replay=tcp://*:5558, or tcp://*:5557,"
                "replay=tcp://*:5558 for every worker not named")
        url: str | None = None
        rest = spec
        if spec.startswith(("http://", "https://")):
            url, sep, rest = spec.partition("=")
            if not sep or not rest:
                raise ValueError(f"--worker-kv-events {spec!r}: {form}")
        elif "=" in spec.split(",", 1)[0]:
            raise ValueError(f"--worker-kv-events {spec!r}: {form}")
        endpoint, *options = rest.split(",")
        check_endpoint(endpoint)
        values: dict[str, str] = {}
        for option in options:
            name, eq, value = option.partition("=")
            if not eq or name not in ("replay", "topic", "dp"):
                raise ValueError(f"--worker-kv-events {spec!r}: unknown option {option!r}; "
                                 f"{form}")
            values[name] = value
        replay = values.get("replay")
        if replay is not None:
            check_endpoint(replay)
        dp = values.get("dp", "1")
        if not dp.isdigit() or int(dp) < 1:
            raise ValueError(f"--worker-kv-events {spec!r}: dp must be an integer >= 1")
        if url is None and not (endpoint.startswith("tcp://") and is_bind_endpoint(endpoint)):
            raise ValueError(f"--worker-kv-events {spec!r}: a source for every worker must be "
                             "one each worker binds, tcp://*:PORT (the gateway connects to "
                             "each worker's host); name the worker (URL=ENDPOINT) otherwise")
        source = cls(endpoint, replay, values.get("topic", ""), int(dp))
        return (url.rstrip("/") if url is not None else None), source
