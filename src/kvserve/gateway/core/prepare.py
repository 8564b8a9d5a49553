"""From a client's request to what the routing core decides on: its tenant, the body a worker
gets (the tenant's salt injected, the client's own dropped), the headers passed on, and the
route key. Pure (no HTTP, no asyncio): kvserve's proxy and the Endpoint Picker both call
`prepare_request`, so a request is keyed and salted alike whichever front end sees it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.gateway.core.adapters import AdapterCatalog
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.route_key import route_request_for
from kvserve.gateway.core.tenancy import Identity, Tenancy
from kvserve.gateway.core.token_keys import TokenKeyer


class Refused(Exception):
    """The request is answered by the gateway itself with `status` (400 bad input, 401 unknown
    key), and reaches no worker."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to route: `body` is what the worker gets, `headers` what it is told
    besides, `route` what the policy sees."""

    identity: Identity
    body: dict[str, Any]
    headers: dict[str, str]
    route: RouteRequest

    @property
    def salt(self) -> str | None:
        return self.identity.salt


def parse_json(raw: bytes) -> Any:
    """Strict JSON: NaN, Infinity and overflowing floats are refused (they could not be
    forwarded as JSON), and so is nesting too deep to parse; each raises ValueError."""
    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"number {text} is out of range")
        return value

    def constant(name: str) -> float:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_float=finite, parse_constant=constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


def prepare_request(path: str, raw: bytes, headers: Mapping[str, str], tenancy: Tenancy,
                    keyer: TokenKeyer | None = None, worker_api_key: str | None = None,
                    trusted_salt_key: str | None = None,
                    adapters: AdapterCatalog | None = None) -> Prepared:
    """Parse, authenticate, salt and key one request to `path` (a completions or chat route);
    `headers` have lower-case names. With `adapters`, the request's LoRA adapter (its `model`
    when a worker lists it, else its tenant's) keys it, and a tenant's adapter replaces the
    body's `model`. Raises Refused saying what the client must fix."""
    try:
        body = parse_json(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise Refused(400, f"the request body is not valid JSON ({exc}): send a JSON object "
                      "(UTF-8)", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object", "invalid_request_error")
    identity = tenancy.resolve(headers)
    if identity.refused is not None:
        raise Refused(401, identity.refused, "authentication_error")
    body.pop("cache_salt", None)  # never trust a client's salt
    if identity.salt is not None:
        body["cache_salt"] = identity.salt
    model = body.get("model")
    adapter = (adapters.resolve(model if isinstance(model, str) else None, identity.tenant)
               if adapters is not None else None)
    try:
        route = route_request_for(path, body, identity.salt, keyer, adapter)
    except ValueError as exc:
        raise Refused(400, str(exc), "invalid_request_error") from None
    if adapter is not None:
        body["model"] = adapter.name  # the worker serves the tenant's adapter
    forwarded = tenancy.upstream_headers(headers, identity, worker_api_key, trusted_salt_key)
    return Prepared(identity, body, forwarded, route)
