"""Server settings (what `kvserve serve` flags set beyond the engine's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """`max_waiting_requests`: admitted-but-not-running requests beyond which new ones get 429.
    `request_timeout_s`: a server deadline per request (None: none). `api_key`: required on
    /v1 routes when set; `admin_key` (default: `api_key`) guards /debug routes."""

    api_key: str | None = None
    admin_key: str | None = None
    max_waiting_requests: int = 256
    request_timeout_s: float | None = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 10.0
    retry_after_s: int = 1
