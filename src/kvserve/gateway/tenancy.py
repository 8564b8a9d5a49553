"""Who a request belongs to, and the cache salt the gateway injects for it.

The tenant comes from a trusted header (set by the platform's auth proxy) or, failing that, from
the API key; a client-sent `cache_salt` is never trusted. Tenants in one sharing group get the
same salt, so they share prefix blocks; everyone else is isolated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Tenancy:
    header: str = "x-tenant-id"
    groups: Mapping[str, str] = field(default_factory=dict)  # tenant -> sharing group
    secret: str = "kvserve"  # mixed into salts so they cannot be guessed from tenant names

    def resolve(self, headers: Mapping[str, str]) -> tuple[str | None, str | None]:
        """(tenant, salt) for a request's headers; (None, None) for anonymous traffic."""
        tenant = headers.get(self.header)
        if not tenant:
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer ") and len(auth) > 7:
                tenant = "key-" + hashlib.sha256(auth[7:].encode()).hexdigest()[:12]
        if not tenant:
            return None, None
        scope = self.groups.get(tenant, tenant)
        salt = hashlib.sha256(f"{self.secret}\x00{scope}".encode()).hexdigest()[:32]
        return tenant, salt

    @classmethod
    def from_specs(cls, specs: list[str], header: str, secret: str) -> Tenancy:
        """Sharing groups from `TENANT=GROUP` strings."""
        groups = {}
        for spec in specs:
            tenant, sep, group = spec.partition("=")
            if not sep or not tenant or not group:
                raise ValueError(f"--share-group {spec!r}: expected TENANT=GROUP")
            groups[tenant] = group
        return cls(header=header.lower(), groups=groups, secret=secret)
