"""The harness the planted-bug tests drive the cache with: an engine-like driver and its checks.

After every step the driver runs what the engine runs: `verify` for each live request and
`audit(live_request_ids=...)`; failed allocations are also checked for all-or-nothing. A planted
bug counts as caught only if a check fires within a few steps and names the culprit (block,
request, epochs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.kvcache import (
    AuditReport,
    CacheCorruption,
    FreeReason,
    KVCacheManager,
    PrefixHit,
    SlotAllocation,
    Violation,
    ViolationKind,
)
from tests.kvcache.conftest import FakeClock

BS = 4


def snapshot(manager: KVCacheManager) -> dict[str, object]:
    """Everything a failed allocation must leave as it was (DESIGN invariant 3), statistics
    included."""
    pool = manager.pool
    stats = manager.stats()
    return {
        "refcounts": [b.ref_cnt for b in pool.blocks],
        "epochs": [b.epoch for b in pool.blocks],
        "free_queue": pool.free_queue.block_ids(),
        "hash_map": {key: b.block_id for key, b in pool.cached.items()},
        "stats": stats,
        "ledger": {
            r.request_id: (tuple(r.block_ids), r.num_computed_tokens, r.last_active)
            for r in manager.ledger
        },
    }


def diff_snapshots(before: dict[str, object], after: dict[str, object]) -> str:
    """'' when equal, else which parts changed (and which blocks' refcounts)."""
    parts = []
    for key in before:
        if before[key] != after[key]:
            if key == "refcounts":
                changed = [
                    (i, a, b)
                    for i, (a, b) in enumerate(zip(before[key], after[key], strict=True))
                    if a != b
                ]
                parts.append(f"refcounts (block, before, after) {changed}")
            else:
                parts.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    return "; ".join(parts)


def named(violations: list[Violation]) -> set[tuple[int | None, str | None]]:
    """The (block, request) pairs the violations name."""
    return {(v.block_id, v.request_id) for v in violations}


@dataclass
class Findings:
    """What the checks saw after one step; `ok` when nothing fired."""

    report: AuditReport | None = None
    corruptions: list[CacheCorruption] = field(default_factory=list)
    all_or_nothing: list[str] = field(default_factory=list)
    error: AssertionError | None = None

    @property
    def ok(self) -> bool:
        return (
            (self.report is None or self.report.ok)
            and not self.corruptions
            and not self.all_or_nothing
            and self.error is None
        )

    def violations(self, kind: ViolationKind) -> list[Violation]:
        assert self.report is not None, f"no audit ran: {self}"
        return [v for v in self.report.violations if v.kind is kind]

    def named(self, kind: ViolationKind) -> set[tuple[int | None, str | None]]:
        """The (block, request) pairs the violations of `kind` name."""
        return named(self.violations(kind))

    def describe(self) -> str:
        lines = [self.report.describe()] if self.report is not None else []
        lines += [f"verify: {e}" for e in self.corruptions]
        lines += [f"all-or-nothing: {d}" for d in self.all_or_nothing]
        if self.error is not None:
            lines.append(f"assertion in the cache: {self.error}")
        return "\n".join(lines)


class Engine:
    """Just enough engine to drive the cache: it keeps the live set (the engine's truth), prefills
    in chunks, decodes, frees, and after each step runs the checks a real engine runs. With a
    host tier, a step's copies run (and are confirmed) before its KV is committed."""

    def __init__(self, num_blocks: int, num_host_slots: int = 0, num_disk_slots: int = 0) -> None:
        self.clock = FakeClock()
        self.mgr = KVCacheManager(num_blocks, BS, clock=self.clock, num_host_slots=num_host_slots,
                                  num_disk_slots=num_disk_slots)
        self.live: set[str] = set()
        self.all_or_nothing: list[str] = []
        self.tokens: dict[str, list[int]] = {}

    def add(self, rid: str, tokens: list[int], salt: str | None = None) -> None:
        self.mgr.add_request(rid, tokens, cache_salt=salt)
        self.live.add(rid)
        self.tokens[rid] = list(tokens)

    def allocate(
        self, rid: str, num_new: int, hit: PrefixHit | None = None
    ) -> SlotAllocation | None:
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(rid, num_new, hit)
        if out is None and (delta := diff_snapshots(before, snapshot(self.mgr))):
            self.all_or_nothing.append(f"allocate_slots({rid!r}) said no but changed {delta}")
        return out

    def admit(self, rid: str, upto: int | None = None, commit_upto: int | None = None) -> bool:
        """Lookup + allocate slots for tokens [0, upto) + commit up to `commit_upto`."""
        upto = len(self.tokens[rid]) if upto is None else upto
        hit = self.mgr.lookup(rid)
        if self.allocate(rid, upto - hit.num_tokens, hit) is None:
            return False  # stays waiting
        self.run_copies()
        self.mgr.commit(rid, upto if commit_upto is None else commit_upto)
        return True

    def prefill(self, rid: str, upto: int) -> bool:
        computed = self.mgr.num_computed_tokens(rid)
        if self.allocate(rid, upto - computed) is None:
            return False
        self.run_copies()
        self.mgr.commit(rid, upto)
        return True

    def decode(self, rid: str, token: int) -> bool:
        self.mgr.append_token_ids(rid, [token])
        self.tokens[rid].append(token)
        return self.prefill(rid, len(self.tokens[rid]))

    def run_copies(self) -> None:
        """The model runs the step's copies between the tiers; they are confirmed."""
        self.mgr.complete_transfers(self.mgr.take_transfers())

    def finish(self, rid: str, reason: FreeReason = FreeReason.FINISHED) -> None:
        self.mgr.free(rid, reason)
        self.live.discard(rid)

    def forget(self, rid: str) -> None:
        """The engine bug: the request ends (client gone) and nobody calls free."""
        self.live.discard(rid)

    def check(self) -> Findings:
        corruptions = []
        for rid in sorted(self.live):
            try:
                self.mgr.verify(rid)
            except CacheCorruption as exc:
                corruptions.append(exc)
        report = self.mgr.audit(live_request_ids=self.live)
        return Findings(report, corruptions, list(self.all_or_nothing))

    def table(self, rid: str) -> list[int]:
        return self.mgr.block_table(rid)


Step = Callable[[], object]


def run(engine: Engine, steps: list[Step]) -> tuple[int, Findings] | None:
    """Run steps, checking after each; the first step (1-based) whose checks fire, or None."""
    for number, step in enumerate(steps, 1):
        try:
            step()
        except AssertionError as exc:  # a cache-internal assertion fired mid-step
            return number, Findings(error=exc)
        findings = engine.check()
        if not findings.ok:
            return number, findings
    return None


def run_clean(engine: Engine, steps: list[Step]) -> None:
    """Run steps that must pass every check."""
    result = run(engine, steps)
    assert result is None, f"step {result[0]}:\n{result[1].describe()}"


def caught(engine: Engine, steps: list[Step], within: int) -> Findings:
    """Run steps that plant a bug; the checks must fire within `within` steps."""
    result = run(engine, steps)
    assert result is not None, "the planted bug slipped through every check"
    number, findings = result
    assert number <= within, f"caught only at step {number}:\n{findings.describe()}"
    return findings
