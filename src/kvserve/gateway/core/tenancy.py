"""Who a request belongs to, and the cache salt the gateway injects for it.

The tenant comes from authentication, never from what a client says about itself:
- with API keys mapped to tenants (`--api-keys-file`), the key decides; an unknown or missing key
  is refused, and a client's tenant header is ignored;
- with `trust_header` (`--trust-tenant-header`: an authenticating layer in front sets the header
  and strips clients' own), the header decides;
- otherwise each bearer key is its own tenant, and a request with no key is anonymous (no salt).
A client-sent `cache_salt` is never trusted. Tenants in one sharing group get the same salt, so
they share prefix blocks; everyone else is isolated. Salts are keyed by a secret the gateway
alone holds (HMAC-SHA256), so nobody outside can compute one from a tenant's name.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.wire.http import SALT_KEY_HEADER, TENANT_HEADER

MIN_SECRET_CHARS = 16  # a salt secret shorter than this could be guessed


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's tenant and salt (both None for anonymous traffic), or why it is refused
    (`refused` set: answer 401 and forward nothing)."""

    tenant: str | None = None
    salt: str | None = None
    refused: str | None = None


@dataclass(frozen=True, slots=True)
class Tenancy:
    """Resolves identities from request headers (lower-case names); see the module doc."""

    secret: str
    groups: Mapping[str, str] = field(default_factory=dict)  # tenant -> sharing group
    key_tenants: Mapping[str, str] = field(default_factory=dict)  # sha256(key) hex -> tenant
    trust_header: bool = False
    header: str = TENANT_HEADER

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the salt secret must be at least {MIN_SECRET_CHARS} characters "
                             "(e.g. `openssl rand -hex 32`)")
        if self.trust_header and self.key_tenants:
            raise ValueError("--trust-tenant-header and --api-keys-file exclude each other: "
                             "either the API key decides the tenant, or the layer in front "
                             "that sets the tenant header does")

    @property
    def authenticates(self) -> bool:
        """True when the gateway checks API keys itself (so it never forwards a client's)."""
        return bool(self.key_tenants)

    def resolve(self, headers: Mapping[str, str]) -> Identity:
        """The identity for a request's headers (names lower-case)."""
        key = bearer_key(headers)
        if self.key_tenants:
            tenant = None if key is None else self.key_tenants.get(_digest(key))
            if tenant is None:
                return Identity(refused="missing or unknown API key: send "
                                        "'Authorization: Bearer <key>' with a key the "
                                        "gateway's --api-keys-file lists")
        elif self.trust_header and headers.get(self.header):
            tenant = headers[self.header]
        elif key is not None:
            tenant = "key-" + _digest(key)[:12]
        else:
            return Identity()
        return Identity(tenant, self.salt_for(tenant))

    def upstream_headers(self, headers: Mapping[str, str], identity: Identity,
                         worker_api_key: str | None = None,
                         trusted_salt_key: str | None = None) -> dict[str, str]:
        """What a worker is told besides the body: the request id; the client's key, unless the
        gateway checks keys itself (then `worker_api_key`, if any); and, for a salted request,
        the tenant and the key that proves the salt is the gateway's. A client's own tenant and
        salt-key headers are never passed on."""
        forwarded = {"x-request-id": headers["x-request-id"]} if "x-request-id" in headers \
            else {}
        if not self.authenticates:
            if "authorization" in headers:
                forwarded["authorization"] = headers["authorization"]
        elif worker_api_key is not None:
            forwarded["authorization"] = f"Bearer {worker_api_key}"
        if identity.salt is not None and trusted_salt_key is not None:
            forwarded[SALT_KEY_HEADER] = trusted_salt_key
            if identity.tenant is not None:
                forwarded[TENANT_HEADER] = identity.tenant
        return forwarded

    def salt_for(self, tenant: str) -> str:
        """The cache salt of `tenant` (its sharing group's, when it has one)."""
        scope = self.groups.get(tenant, tenant)
        return hmac.new(self.secret.encode(), scope.encode(), hashlib.sha256).hexdigest()[:32]

    @classmethod
    def from_options(cls, secret: str, share_groups: Sequence[str] = (),
                     api_keys_file: str | None = None, trust_header: bool = False,
                     header: str = TENANT_HEADER) -> Tenancy:
        """Sharing groups from `TENANT=GROUP` strings, key tenants from a keys file (see
        `read_api_keys`). Raises ValueError saying what to fix."""
        groups = {}
        for spec in share_groups:
            tenant, sep, group = spec.partition("=")
            if not sep or not tenant or not group:
                raise ValueError(f"--share-group {spec!r}: expected TENANT=GROUP")
            groups[tenant] = group
        keys = read_api_keys(Path(api_keys_file)) if api_keys_file else {}
        return cls(secret=secret, groups=groups, key_tenants=keys, trust_header=trust_header,
                   header=header.lower())


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return None


def has_bearer(headers: Mapping[str, str], expected: str) -> bool:
    """True when the request's bearer key is `expected` (compared in constant time)."""
    key = bearer_key(headers)
    return key is not None and hmac.compare_digest(key.encode(), expected.encode())


def read_api_keys(path: Path) -> dict[str, str]:
    """{sha256(key) hex: tenant} from a file of `TENANT KEY` lines (`#` comments, blank lines
    skipped). Only digests are kept: looking a key up compares no secret byte by byte. Raises
    ValueError naming the line that is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from exc
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"--api-keys-file {path}, line {number}: expected 'TENANT KEY' "
                             f"(two fields separated by spaces), got {len(parts)} fields")
        tenant, key = parts
        if len(key) < MIN_SECRET_CHARS:
            raise ValueError(f"--api-keys-file {path}, line {number}: tenant {tenant!r}'s key "
                             f"is shorter than {MIN_SECRET_CHARS} characters")
        digest = _digest(key)
        if digest in keys and keys[digest] != tenant:
            raise ValueError(f"--api-keys-file {path}, line {number}: this key already "
                             f"belongs to tenant {keys[digest]!r}")
        keys[digest] = tenant
    if not keys:
        raise ValueError(f"--api-keys-file {path} lists no 'TENANT KEY' line")
    return keys


def generated_secret() -> str:
    """A random salt secret for a gateway that was given none."""
    return secrets.token_hex(32)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
