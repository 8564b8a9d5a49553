"""When the scheduler checks the KV cache's books: on a drain, and every so many busy steps.

The checks themselves live in the cache (`KVCacheManager.check_idle`, `check_idle_quick`,
`audit`, `reap`); this is only their cadence, kept by the scheduler after every step.
"""

from __future__ import annotations

from collections.abc import Collection

from kvserve.engine.config import SchedulerConfig
from kvserve.kvcache import AuditReport, KVCacheManager


class IntegrityChecks:
    """The due check after a step: when the engine just drained, the idle check (the full
    audit instead once `idle_audit_interval_s` has passed since a drain last ran it); while
    busy, the full audit every `audit_interval_steps` steps. Never changes the cache unless a
    check failed: then blocks held by requests the scheduler no longer knows are reaped."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._was_idle = True
        self._last_idle_audit: float | None = None  # when a drain last ran the full audit

    def after_step(self, now: float, idle: bool, num_steps: int,
                   live_request_ids: Collection[str]) -> AuditReport | None:
        """The check due after step `num_steps` (`idle`: nothing left to run), with the
        scheduler's `live_request_ids`; None when nothing was due."""
        interval = self.config.audit_interval_steps
        report = None
        if idle and not self._was_idle:
            last = self._last_idle_audit
            if last is None or now - last >= self.config.idle_audit_interval_s:
                report = self.kv_cache.check_idle()
                self._last_idle_audit = now
            else:
                report = self.kv_cache.check_idle_quick()
        elif not idle and interval and num_steps % interval == 0:
            report = self.kv_cache.audit(set(live_request_ids))
        self._was_idle = idle
        if report is not None and not report.ok:
            self.kv_cache.reap(live_request_ids=set(live_request_ids))
        return report
