"""Which callers a worker believes about tenancy: the cache salt and the tenant header.

A salt decides whose cached prefixes a request may hit, so a worker started with
`--trusted-salt-key` takes `cache_salt` (and the `x-tenant-id` the gateway names) only from a
caller that presents that key in `X-KVServe-Salt-Key` — the gateway. Anyone else's salt is
refused with a 403, or stripped (`--untrusted-salt strip`: the request is served from the
unsalted pool, which holds no tenant's blocks); either way it is counted. Without the key a
worker takes salts from anyone, as vLLM does.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvserve.server.errors import APIError
from kvserve.server.settings import UntrustedSalt
from kvserve.wire.http import SALT_KEY_HEADER, TENANT_HEADER


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request's salt and tenant as this worker accepts them."""

    cache_salt: str | None
    tenant: str | None  # the gateway-named tenant; None unless trusted


class SaltTrust:
    """Applies the rule in the module doc, counting what it refused or stripped."""

    def __init__(self, key: str | None, untrusted: UntrustedSalt,
                 registry: CollectorRegistry) -> None:
        self.key = key
        self.untrusted = untrusted
        self.counter = Counter("kvserve:untrusted_salt_requests",
                               "Requests whose cache_salt or tenant header came without the "
                               "trusted salt key, by what the worker did with them.",
                               ["action"], registry=registry)

    def accept(self, headers: Mapping[str, str], cache_salt: str | None) -> Accepted:
        """The salt and tenant to use; raises APIError (403) for an untrusted salt when so
        configured."""
        tenant = headers.get(TENANT_HEADER) or None
        if self.key is None:
            return Accepted(cache_salt, None)
        given = headers.get(SALT_KEY_HEADER, "")
        if hmac.compare_digest(given.encode(), self.key.encode()):
            return Accepted(cache_salt, tenant)
        if cache_salt is None and tenant is None:
            return Accepted(None, None)
        self.counter.labels(self.untrusted.value).inc()
        if self.untrusted is UntrustedSalt.REFUSE:
            raise APIError(403, "this worker takes cache_salt and X-Tenant-Id only from its "
                           "gateway (--trusted-salt-key): send the request through the "
                           "gateway, or without them", param="cache_salt",
                           err_type="permission_error")
        return Accepted(None, None)
