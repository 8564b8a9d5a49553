"""The doctor's verdicts as plain values: a finding is one problem on one target, with the
evidence that shows it; a report is every target's findings and the exit status they imply."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Severity(enum.IntEnum):
    """Ordered; the report's exit status is the highest severity found (Nagios-style codes)."""

    INFO = 0
    WARNING = 1
    CRITICAL = 2


class Problem(enum.StrEnum):
    """What kind of trouble a finding is (the three failures kvserve exists to prevent first)."""

    COLLECTIVE = "collective"  # tensor-parallel: a failed or slow collective, a slow rank
    LEAK = "leak"
    CORRUPTION = "corruption"
    AUDIT = "audit"
    THRASHING = "thrashing"  # the prefix cache: blocks evicted before reuse
    ADAPTER_THRASHING = "adapter_thrashing"  # LoRA slots: adapters reloaded while others wait
    SATURATION = "saturation"
    MISCONFIGURATION = "misconfiguration"
    DOWN = "down"
    NOTE = "note"


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem on `target` (a URL, or "fleet"): `title` says what, `evidence` the numbers
    that show it, `request_ids` the requests involved (leaks). Never mutated once made."""

    target: str
    problem: Problem
    severity: Severity
    title: str
    evidence: tuple[str, ...] = ()
    request_ids: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "problem": self.problem.value,
                "severity": self.severity.name.lower(), "title": self.title,
                "evidence": list(self.evidence), "request_ids": list(self.request_ids)}


@dataclass(frozen=True, slots=True)
class TargetSummary:
    """A line about each target the doctor read: its kind and a few headline numbers."""

    url: str
    kind: str
    facts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "kind": self.kind, **self.facts}


@dataclass(frozen=True, slots=True)
class Report:
    """The diagnosis of every target over one observation window of `interval_s` seconds."""

    interval_s: float
    targets: tuple[TargetSummary, ...]
    findings: tuple[Finding, ...]

    @property
    def severity(self) -> Severity:
        return max((f.severity for f in self.findings), default=Severity.INFO)

    @property
    def exit_code(self) -> int:
        """0 healthy (notes only), 1 warnings, 2 something critical."""
        return int(self.severity)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity > Severity.INFO]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.exit_code == 0, "exit_code": self.exit_code,
                "severity": self.severity.name.lower(), "interval_s": round(self.interval_s, 3),
                "targets": [t.to_dict() for t in self.targets],
                "findings": [f.to_dict() for f in self.findings]}
