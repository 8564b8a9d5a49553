"""Server settings (what `kvserve serve` flags set beyond the engine's)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.kvevents.config import KVEventsConfig
from kvserve.server.tools.flags import ToolSettings


class WorkerRole(enum.StrEnum):
    """What a worker does in a disaggregated fleet (`kvserve serve --role`).

    BOTH: today's worker, prompts and decodes alike. PREFILL: also serves /kv/prefill, the
    prompt KV a decode worker pulls. DECODE: pulls a prompt's KV from the prefill worker the
    gateway names (X-KVServe-Prefill-Url) before it generates. Every role serves completions.
    """

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class UntrustedSalt(enum.StrEnum):
    """What a worker with a trusted salt key does with a salt from anyone else
    (kvserve.server.trust)."""

    REFUSE = "refuse"  # 403
    STRIP = "strip"  # served unsalted


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """`max_waiting_requests`: admitted-but-not-running requests beyond which new ones get 429.
    `request_timeout_s`: a server deadline per request (None: none). `api_key`: required on
    /v1 routes when set; `admin_key` guards the admin routes (/debug/kv, /kv/events,
    /kv/prefill; they do not exist without it) and the KV transfer between workers. `role`:
    see `WorkerRole`; `kv_transfer_timeout_s` bounds one KV pull (connect, prefill and every
    read). `trusted_salt_key` /
    `untrusted_salt`: who may send a cache salt (kvserve.server.trust). `metrics_key`: required
    on /metrics when set. `tenant_metric_labels`: label per-tenant metrics by the gateway-named
    tenant rather than a hash of the salt. `enable_api_docs`: serve /docs, /redoc and
    /openapi.json. `max_stop_sequences` / `max_stop_chars`: limits on a request's `stop`.
    `kv_events`: publish KV events on vLLM's wire. `tools`: how tool calls are parsed."""

    api_key: str | None = None
    admin_key: str | None = None
    max_waiting_requests: int = 256
    request_timeout_s: float | None = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 10.0
    retry_after_s: int = 1
    role: WorkerRole = WorkerRole.BOTH
    kv_transfer_timeout_s: float = 60.0
    trusted_salt_key: str | None = None
    untrusted_salt: UntrustedSalt = UntrustedSalt.REFUSE
    metrics_key: str | None = None
    tenant_metric_labels: bool = False
    enable_api_docs: bool = False
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    kv_events: KVEventsConfig | None = None  # publish KV events on vLLM's ZMQ wire
    tools: ToolSettings = field(default_factory=ToolSettings)
