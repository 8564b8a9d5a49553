"""What a gateway front end is configured with (`kvserve gateway`, `kvserve up`, `kvserve epp`):
built from the shared flags by `command.settings_from_args`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.gateway.core.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from kvserve.gateway.core.tenancy import Tenancy, generated_secret
from kvserve.gateway.fleet.discovery import DEFAULT_INTERVAL_S
from kvserve.gateway.fleet.kv_event_source import EventSource


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """`max_in_flight`: requests open upstream at once (fleet-wide; less once the workers'
    batch capacity is known, `admission.py`); beyond it up to `max_queued` wait
    `queue_timeout_s` for a slot (a client that says its timeout: while it can still be
    answered in time, at most `max_queue_wait_s`), then get 429 + Retry-After."""

    workers: tuple[str, ...]
    policy: str = "prefix_hash"
    policy_options: tuple[tuple[str, Any], ...] = ()  # make_policy keyword options
    max_in_flight: int = 256
    max_queued: int = 512
    queue_timeout_s: float = 1.0
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    request_timeout_s: float | None = 600.0
    retry_ratio: float = 0.1
    scrape_interval_s: float = 1.0
    max_body_bytes: int = 8 * 1024 * 1024
    latency_limit: bool = True  # the AIMD limit from late first bytes (`latency_limit.py`)
    seniority: bool = True  # a resend queues in its first send's place (`seniority.py`)
    ttft_target_s: float | None = None  # a first byte later than this is late for that limit
    tenancy: Tenancy = field(default_factory=lambda: Tenancy(generated_secret()))
    worker_api_key: str | None = None  # sent to workers when the gateway checks keys itself
    trusted_salt_key: str | None = None  # sent with salted requests (X-KVServe-Salt-Key)
    metrics_key: str | None = None  # guards this /metrics; sent to the workers' /metrics
    tenant_adapters: tuple[tuple[str, str], ...] = ()  # TENANT -> LoRA adapter (--tenant-adapter)
    tokenizer: str | None = None  # the workers' tokenizer, for exact keys (`precise`)
    block_size: int = 16  # the workers' KV block size, for exact keys
    admin_key: str | None = None  # sent to decode workers (KV transfers)
    # `precise`: where workers publish their KV events (vLLM's ZMQ wire), per worker URL, and
    # for every worker not named (discovered ones too); a worker with neither publishes none.
    worker_kv_events: tuple[tuple[str, EventSource], ...] = ()
    kv_events_default: EventSource | None = None
    # Disaggregated mode (both non-empty): prompts prefilled on `prefill_workers` (by
    # `policy`), decoded on `decode_workers` (by least load); `workers` is then their union.
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    # Discovery (`discovery/`): `workers` plus every address of these NAME:PORTs and the URLs
    # of this file, followed every `discovery_interval_s` without a restart.
    worker_dns: tuple[str, ...] = ()
    workers_file: str | None = None
    discovery_interval_s: float = DEFAULT_INTERVAL_S

    @property
    def is_discovering(self) -> bool:
        return bool(self.worker_dns or self.workers_file)

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)


