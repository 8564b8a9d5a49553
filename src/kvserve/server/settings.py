"""Server settings (what `kvserve serve` flags set beyond the engine's)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.server.tool_flags import ToolSettings


class WorkerRole(enum.StrEnum):
    """What a worker does in a disaggregated fleet (`kvserve serve --role`).

    BOTH: today's worker, prompts and decodes alike. PREFILL: also serves /kv/prefill, the
    prompt KV a decode worker pulls. DECODE: pulls a prompt's KV from the prefill worker the
    gateway names (X-KVServe-Prefill-Url) before it generates. Every role serves completions.
    """

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """`max_waiting_requests`: admitted-but-not-running requests beyond which new ones get 429.
    `request_timeout_s`: a server deadline per request (None: none). `api_key`: required on
    /v1 routes when set; `admin_key` (default: `api_key`) guards /debug routes and the KV
    transfer between workers. `role`: see `WorkerRole`; `kv_transfer_timeout_s` bounds one
    KV pull (connect, prefill and every read). `tools`: how tool calls are parsed."""

    api_key: str | None = None
    admin_key: str | None = None
    max_waiting_requests: int = 256
    request_timeout_s: float | None = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 10.0
    retry_after_s: int = 1
    role: WorkerRole = WorkerRole.BOTH
    kv_transfer_timeout_s: float = 60.0
    tools: ToolSettings = field(default_factory=ToolSettings)
