"""Plant each real-world KV-cache bug class and prove the integrity checks catch it and name it.

Each class gets a short engine-like scenario (a few requests, shared prefixes, memory pressure).
After every step the harness runs what the engine runs: `verify` for each live request and
`audit(live_request_ids=...)`; failed allocations are also checked for all-or-nothing. A test
passes only if a check fires within a few steps and names the culprit (block, request, epochs).
`test_scenario_is_clean_without_the_bug` runs every scenario unpatched, so a test can only fail
for the planted reason. A class that slips through is a design gap: its test is a strict xfail.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

import kvserve.kvcache.manager as manager_module
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
from kvserve.kvcache.block_pool import BlockPool

BS = 4
SYS = list(range(1, 9))  # a 2-block system prompt every chat of a tenant starts with
P1 = [*SYS, 11, 12, 13]  # 11 tokens: 2 full blocks + 3
P2 = [*SYS, 21, 22, 23, 24, 25]  # 13 tokens: 3 full blocks + 1
OTHER = list(range(31, 44))  # 13 tokens, shares nothing
LONG = list(range(51, 71))  # 20 tokens, shares nothing


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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

    def describe(self) -> str:
        lines = [self.report.describe()] if self.report is not None else []
        lines += [f"verify: {e}" for e in self.corruptions]
        lines += [f"all-or-nothing: {d}" for d in self.all_or_nothing]
        if self.error is not None:
            lines.append(f"assertion in the cache: {self.error}")
        return "\n".join(lines)


class Engine:
    """Just enough engine to drive the cache: it keeps the live set (the engine's truth), prefills
    in chunks, decodes, frees, and after each step runs the checks a real engine runs."""

    def __init__(self, num_blocks: int) -> None:
        self.clock = FakeClock()
        self.mgr = KVCacheManager(num_blocks, BS, clock=self.clock)
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
        self.mgr.commit(rid, upto if commit_upto is None else commit_upto)
        return True

    def prefill(self, rid: str, upto: int) -> bool:
        computed = self.mgr.num_computed_tokens(rid)
        if self.allocate(rid, upto - computed) is None:
            return False
        self.mgr.commit(rid, upto)
        return True

    def decode(self, rid: str, token: int) -> bool:
        self.mgr.append_token_ids(rid, [token])
        self.tokens[rid].append(token)
        return self.prefill(rid, len(self.tokens[rid]))

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


def caught(engine: Engine, steps: list[Step], within: int) -> Findings:
    result = run(engine, steps)
    assert result is not None, "the planted bug slipped through every check"
    number, findings = result
    assert number <= within, f"caught only at step {number}:\n{findings.describe()}"
    return findings


def named(violations: list[Violation]) -> set[tuple[int | None, str | None]]:
    return {(v.block_id, v.request_id) for v in violations}


# -- scenarios (each a few engine steps; the bug-free run must pass every check) -------------------


def held_eviction(eng: Engine) -> list[Step]:
    """r1 decodes while r2's admission drives the pool to its last free block."""
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: eng.decode("r1", 14),
        lambda: (eng.add("r2", OTHER), eng.admit("r2")),
        lambda: (eng.decode("r1", 15), eng.decode("r2", 44)),
        lambda: (eng.finish("r1"), eng.finish("r2")),
    ]


def abort_mid_prefill(eng: Engine, end_r2: Callable[[], object] | None = None) -> list[Step]:
    """r2 shares r1's system prompt and is aborted mid chunked prefill; then r1 finishes (idle)."""
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: (eng.add("r2", P2), eng.admit("r2", upto=12)),
        end_r2 or (lambda: eng.finish("r2", FreeReason.ABORTED)),
        lambda: eng.decode("r1", 14),
        lambda: eng.finish("r1"),
    ]


def shared_prefix(eng: Engine, r1_finishes_first: bool = False) -> list[Step]:
    """r2 takes r1's system prompt as a prefix hit; both decode; r2 (or r1) finishes first."""
    first, second = ("r1", "r2") if r1_finishes_first else ("r2", "r1")
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: (eng.add("r2", P2), eng.admit("r2")),
        lambda: (eng.decode("r1", 14), eng.decode("r2", 26)),
        lambda: eng.finish(first),
        lambda: (eng.add("r3", OTHER), eng.admit("r3")),
        lambda: (eng.finish(second), eng.finish("r3")),
    ]


def reuse_after_finish(eng: Engine) -> list[Step]:
    """r1 finishes (its prefix stays cached); r2's chunked prefill evicts r1's deepest block."""
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: eng.finish("r1"),
        lambda: (eng.add("r2", LONG), eng.admit("r2", upto=16)),
        lambda: eng.prefill("r2", 20),
        lambda: eng.finish("r2"),
    ]


def two_tenants(eng: Engine) -> list[Step]:
    """Tenants a and b send prompts with the same system prompt."""
    return [
        lambda: (eng.add("a1", P1, salt="tenant-a"), eng.admit("a1")),
        lambda: (eng.add("b1", P2, salt="tenant-b"), eng.admit("b1")),
        lambda: (eng.decode("a1", 14), eng.decode("b1", 26)),
        lambda: (eng.finish("a1"), eng.finish("b1")),
    ]


def refused_admission(eng: Engine) -> list[Step]:
    """r2's prefix hit is on free-cached blocks, but its admission does not fit: refused."""
    big = [*SYS, *range(60, 75)]  # 23 tokens: 6 blocks, 2 of them the cached system prompt
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: eng.finish("r1"),
        lambda: (eng.add("r3", OTHER), eng.admit("r3")),
        lambda: (eng.add("r2", big), eng.admit("r2")),  # 4 free < 4 new + 2 reclaimed hits
        lambda: eng.finish("r3"),
        lambda: eng.admit("r2"),
        lambda: eng.finish("r2"),
    ]


def chunked_prefill_allocated_ahead(eng: Engine) -> list[Step]:
    """r1's whole prompt gets slots at admission; the model writes it 4 tokens a step."""
    return [
        lambda: (eng.add("r1", P2), eng.admit("r1", commit_upto=4)),
        lambda: eng.mgr.commit("r1", 8),
        lambda: eng.mgr.commit("r1", 12),
        lambda: eng.mgr.commit("r1", 13),
        lambda: (eng.add("r2", [*P2, 99]), eng.admit("r2")),
        lambda: (eng.finish("r1"), eng.finish("r2")),
    ]


def stashed_hit(eng: Engine, stash: dict[str, PrefixHit]) -> list[Step]:
    """The engine looks up r2 early in the step and allocates it after r3 was admitted (and
    evicted a block of r2's hit) and r4 finished. The cache must refuse the now-stale hit."""

    def allocate_r2_with_stashed_hit() -> None:
        hit = stash["r2"]
        if eng.allocate("r2", len(P2) - hit.num_tokens, hit) is not None:
            eng.mgr.commit("r2", len(P2))

    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: (eng.add("r4", OTHER), eng.admit("r4")),
        lambda: eng.finish("r1"),
        lambda: (eng.add("r2", P2), stash.__setitem__("r2", eng.mgr.lookup("r2"))),
        lambda: (eng.add("r3", LONG), eng.admit("r3", upto=17, commit_upto=16)),
        lambda: eng.finish("r4"),
        allocate_r2_with_stashed_hit,
    ]


SCENARIOS: dict[str, tuple[int, Callable[[Engine], list[Step]]]] = {
    "held_eviction": (8, held_eviction),
    "abort_mid_prefill": (10, abort_mid_prefill),
    "shared_prefix": (10, shared_prefix),
    "shared_prefix_r1_first": (10, lambda eng: shared_prefix(eng, r1_finishes_first=True)),
    "reuse_after_finish": (6, reuse_after_finish),
    "two_tenants": (10, two_tenants),
    "refused_admission": (8, refused_admission),
    "chunked_prefill_allocated_ahead": (10, chunked_prefill_allocated_ahead),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_is_clean_without_the_bug(name: str) -> None:
    num_blocks, scenario = SCENARIOS[name]
    eng = Engine(num_blocks)
    result = run(eng, scenario(eng))
    assert result is None, f"step {result[0]}:\n{result[1].describe()}"
    assert not eng.live
    idle = eng.mgr.check_idle()
    assert idle.ok, idle.describe()
    assert eng.mgr.stats().num_free_blocks == num_blocks


def test_stashed_hit_scenario_is_refused_without_the_bug() -> None:
    eng = Engine(10)
    steps = stashed_hit(eng, {})
    assert run(eng, steps[:-1]) is None
    before = snapshot(eng.mgr)
    with pytest.raises(ValueError, match="stale prefix hit"):
        steps[-1]()
    assert diff_snapshots(before, snapshot(eng.mgr)) == ""
    assert eng.check().ok


# -- a. eviction of a held block ---------------------------------------------------------------


def test_a_eviction_of_held_block_is_named_by_verify_and_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = BlockPool.allocate

    def allocate_evicting_held(self: BlockPool, num_blocks: int, *args, **kwargs):
        # BUG: under pressure the last block is reclaimed from the lowest ids, refcount unchecked.
        out = original(self, num_blocks, *args, **kwargs)
        if not out or self.free_queue.num_free_blocks >= 2:
            return out
        victim = next((b for b in self.blocks if b not in out and b.ref_cnt > 0), None)
        if victim is None:
            return out
        spare = out.pop()
        spare.ref_cnt = 0
        self.free_queue.appendleft(spare)
        if victim.block_hash is not None:
            del self.cached[victim.block_hash]
            victim.clear_content()
        victim.epoch += 1
        victim.ref_cnt = 1
        out.append(victim)
        return out

    monkeypatch.setattr(BlockPool, "allocate", allocate_evicting_held)
    eng = Engine(8)
    steps = held_eviction(eng)
    assert run(eng, steps[:2]) is None
    victim = eng.table("r1")[0]
    seen_epoch = eng.mgr.pool.blocks[victim].epoch

    findings = caught(eng, steps[2:], within=1)

    assert len(findings.corruptions) == 1, findings.describe()
    exc = findings.corruptions[0]
    assert (exc.request_id, exc.block_id) == ("r1", victim)
    assert (exc.expected_epoch, exc.actual_epoch) == (seen_epoch, seen_epoch + 1)
    assert f"request 'r1' block {victim}" in str(exc)
    assert named(findings.violations(ViolationKind.EPOCH_MISMATCH)) == {(victim, "r1")}
    assert named(findings.violations(ViolationKind.UNCACHED_SHARE)) == {(victim, "r2")}
    assert victim in {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)}
    assert eng.mgr.stats().counters.corruption_detections == 1


# -- b. leaks: free skipped on abort ------------------------------------------------------------


def _free_ignoring_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.free

    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        if reason is FreeReason.ABORTED:
            return 0  # BUG: the abort path returns early and releases nothing
        return original(self, request_id, reason)

    monkeypatch.setattr(KVCacheManager, "free", free)


@pytest.mark.parametrize("how", ["manager_free_skips_aborted", "engine_never_calls_free"])
def test_b_leaked_request_is_named_with_its_blocks(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    eng = Engine(10)
    if how == "manager_free_skips_aborted":
        _free_ignoring_aborts(monkeypatch)
        steps = abort_mid_prefill(eng)
    else:
        steps = abort_mid_prefill(eng, end_r2=lambda: eng.forget("r2"))
    assert run(eng, steps[:2]) is None
    leaked = eng.table("r2")

    findings = caught(eng, steps[2:], within=1)
    (leak,) = findings.violations(ViolationKind.LEAK)
    assert (leak.request_id, leak.block_id) == ("r2", leaked[0])
    assert str(leaked) in leak.message

    for step in steps[3:]:  # the engine carries on until it is idle
        step()
    idle = eng.mgr.check_idle()
    assert idle.kinds() == {ViolationKind.LEAK, ViolationKind.HELD_WHILE_IDLE}, idle.describe()
    assert named(idle.violations) >= {(leaked[0], "r2")}
    held_while_idle = next(v for v in idle.violations if v.kind is ViolationKind.HELD_WHILE_IDLE)
    assert held_while_idle.block_id in leaked
    assert all(str(b) in held_while_idle.message for b in leaked)

    # The reaper reclaims what the dead request left, and counts it.
    eng.clock.now += 301
    assert eng.mgr.reap(idle_timeout_s=300) == ["r2"]
    assert eng.mgr.stats().counters.reclaimed_blocks == len(leaked)
    assert eng.mgr.check_idle().ok


def _free_dropping_ledger_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        record = self.ledger.pop(request_id)  # BUG: the ledger forgets, the pool is never told
        return len(record.block_table) if record is not None else 0

    monkeypatch.setattr(KVCacheManager, "free", free)


def test_b_blocks_leaked_past_the_ledger_are_caught_and_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _free_dropping_ledger_only(monkeypatch)
    eng = Engine(10)
    steps = abort_mid_prefill(eng)
    assert run(eng, steps[:2]) is None
    r1_blocks, leaked = eng.table("r1"), eng.table("r2")

    findings = caught(eng, steps[2:], within=1)
    mismatched = {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)}
    assert mismatched == set(leaked)

    for step in steps[3:]:
        step()
    idle = eng.mgr.check_idle()
    assert ViolationKind.HELD_WHILE_IDLE in idle.kinds(), idle.describe()
    # r1 has also gone through the broken free, so its blocks are stranded too.
    assert {v.block_id for v in idle.violations if v.kind is ViolationKind.REFCOUNT_MISMATCH} == (
        set(leaked) | set(r1_blocks)
    )


def test_b_blocks_leaked_past_the_ledger_still_name_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the ledger entry gone, the blocks' last owner is the only witness left."""
    _free_dropping_ledger_only(monkeypatch)
    eng = Engine(10)
    steps = abort_mid_prefill(eng)
    assert run(eng, steps[:2]) is None
    leaked = eng.table("r2")
    findings = caught(eng, steps[2:], within=1)
    for violation in findings.violations(ViolationKind.REFCOUNT_MISMATCH):
        assert violation.request_id == "r2" or "'r2'" in violation.message, violation
    unshared = [b for b in leaked if b not in eng.table("r1")]
    assert named(findings.violations(ViolationKind.REFCOUNT_MISMATCH)) >= {
        (b, "r2") for b in unshared
    }


# -- c. double free ------------------------------------------------------------------------------


def _free_releasing_twice(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    original = KVCacheManager.free

    def free(self: KVCacheManager, request_id: str, reason: FreeReason = FreeReason.FINISHED):
        record = self.ledger.get(request_id)
        table = list(record.block_table) if record is not None else []
        hits = table[: record.num_cached_tokens // self.block_size] if record is not None else []
        num = original(self, request_id, reason)
        # BUG: a second release, of the whole table or of the prefix-hit blocks kept on the side.
        self.pool.free(reversed(table if which == "whole_table" else hits))
        return num

    monkeypatch.setattr(KVCacheManager, "free", free)


@pytest.mark.parametrize(("which", "r1_first"), [("whole_table", False), ("prefix_hits", True)])
def test_c_double_free_assertion_names_the_block(
    monkeypatch: pytest.MonkeyPatch, which: str, r1_first: bool
) -> None:
    _free_releasing_twice(monkeypatch, which)
    eng = Engine(10)
    steps = shared_prefix(eng, r1_finishes_first=r1_first)
    assert run(eng, steps[:3]) is None
    r1_blocks, r2_blocks = eng.table("r1"), eng.table("r2")

    findings = caught(eng, steps[3:], within=3)
    assert findings.error is not None, findings.describe()
    match = re.search(r"double free of KVBlock\(id=(\d+)", str(findings.error))
    assert match, str(findings.error)
    culprit = int(match.group(1))
    assert culprit in (r2_blocks[:2] if r1_first else r1_blocks + r2_blocks)


def test_c_double_free_of_a_shared_prefix_is_named_by_audit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r2's prefix-hit blocks are released twice while r1 still holds them: no assertion fires
    (refcount 2 -> 0), so the audit must name the blocks and their rightful holder."""
    _free_releasing_twice(monkeypatch, "prefix_hits")
    eng = Engine(10)
    steps = shared_prefix(eng)
    assert run(eng, steps[:3]) is None
    shared = eng.table("r2")[:2]
    assert shared == eng.table("r1")[:2]

    findings = caught(eng, steps[3:], within=1)
    assert findings.error is None
    assert named(findings.violations(ViolationKind.REFCOUNT_MISMATCH)) == {
        (b, "r1") for b in shared
    }
    # verify sees it too: r1's blocks were released under it.
    assert [(e.request_id, e.block_id) for e in findings.corruptions] == [("r1", shared[0])]


def test_c_engine_freeing_twice_is_a_counted_no_op() -> None:
    eng = Engine(10)
    steps = shared_prefix(eng)
    assert run(eng, steps[:4]) is None
    before = snapshot(eng.mgr)
    assert eng.mgr.free("r2", FreeReason.ABORTED) == 0
    after = snapshot(eng.mgr)
    assert [key for key in before if before[key] != after[key]] == ["stats"]
    assert eng.mgr.stats().counters.redundant_frees == 1
    assert run(eng, steps[4:]) is None


# -- d. refcount off by one --------------------------------------------------------------------


def test_d_touch_counting_twice_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.touch

    def touch(self: BlockPool, blocks, *args, **kwargs) -> None:
        blocks = list(blocks)
        original(self, blocks, *args, **kwargs)
        for block in blocks:
            block.ref_cnt += 1  # BUG: a hit takes two references

    monkeypatch.setattr(BlockPool, "touch", touch)
    eng = Engine(10)
    steps = shared_prefix(eng)
    assert run(eng, steps[:1]) is None
    shared = eng.table("r1")[:2]

    findings = caught(eng, steps[1:], within=1)
    assert named(findings.violations(ViolationKind.REFCOUNT_MISMATCH)) == {
        (b, "r1") for b in shared
    }
    assert all("refcount 3 but 2 holders" in v.message for v in findings.report.violations)


def _free_dropping_two_references(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.free

    def free(self: BlockPool, blocks, *args, **kwargs) -> None:
        blocks = list(blocks)
        original(self, blocks, *args, **kwargs)
        for block in blocks:
            block.ref_cnt -= 1  # BUG: each release drops two references

    monkeypatch.setattr(BlockPool, "free", free)


def test_d_free_dropping_two_references_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _free_dropping_two_references(monkeypatch)
    eng = Engine(10)
    steps = shared_prefix(eng)
    assert run(eng, steps[:3]) is None
    r2_blocks, shared = eng.table("r2"), eng.table("r1")[:2]

    findings = caught(eng, steps[3:], within=1)
    mismatched = findings.violations(ViolationKind.REFCOUNT_MISMATCH)
    assert {v.block_id for v in mismatched} == set(r2_blocks)
    assert {(b, "r1") for b in shared} <= named(mismatched)
    # r2's own blocks went to refcount -1 inside the free queue; the shared ones to 0 outside it.
    assert {v.block_id for v in findings.violations(ViolationKind.HELD_BLOCK_IN_FREE_QUEUE)} == (
        set(r2_blocks) - set(shared)
    )
    assert {v.block_id for v in findings.violations(ViolationKind.LOST_BLOCK)} == set(shared)


def test_d_idle_check_reports_negative_refcounts(monkeypatch: pytest.MonkeyPatch) -> None:
    _free_dropping_two_references(monkeypatch)
    eng = Engine(10)
    steps = held_eviction(eng)  # two requests that share nothing, then both finish
    for step in steps:
        step()
    idle = eng.mgr.check_idle()  # the audit "never raises"
    assert ViolationKind.HELD_WHILE_IDLE in idle.kinds(), idle.describe()
    assert ViolationKind.REFCOUNT_MISMATCH in idle.kinds()


# -- e. stale hash after reuse ----------------------------------------------------------------


def _evict_forgetting(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    original = BlockPool._evict

    def evict_keeping_everything(self: BlockPool, block, *args, **kwargs) -> None:
        return None  # BUG: the evicted block keeps its hash, tokens and map entry

    def evict_keeping_map_entry(self: BlockPool, block, *args, **kwargs) -> None:
        key = block.block_hash
        mapped = self.cached.get(key)
        original(self, block, *args, **kwargs)
        if mapped is block:
            self.cached[key] = block  # BUG: the map entry outlives the eviction

    replacement = evict_keeping_everything if what == "content_and_map" else evict_keeping_map_entry
    monkeypatch.setattr(BlockPool, "_evict", replacement)


@pytest.mark.parametrize(
    ("what", "kind"),
    [("content_and_map", ViolationKind.STALE_HASH), ("map_entry", ViolationKind.HASH_MAP_MISMATCH)],
)
def test_e_stale_hash_after_reuse_is_named(
    monkeypatch: pytest.MonkeyPatch, what: str, kind: ViolationKind
) -> None:
    _evict_forgetting(monkeypatch, what)
    eng = Engine(6)
    steps = reuse_after_finish(eng)
    assert run(eng, steps[:3]) is None
    reused = eng.mgr.pool.free_queue.block_ids()[0]  # r1's deepest cached block: next to evict

    findings = caught(eng, steps[3:], within=1)
    assert eng.table("r2")[-1] == reused
    expected = {(reused, "r2")} if kind is ViolationKind.STALE_HASH else {(reused, None)}
    assert named(findings.violations(kind)) == expected, findings.describe()


@pytest.mark.parametrize("what", ["content_and_map", "map_entry"])
def test_e_lookup_never_serves_a_reused_block(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    _evict_forgetting(monkeypatch, what)
    eng = Engine(6)
    steps = reuse_after_finish(eng)
    for step in steps[:3]:
        step()
    eng.allocate("r2", 4)  # r2 now owns r1's old deepest block and is writing it
    reused = eng.table("r2")[-1]
    eng.add("r3", P1)
    hit = eng.mgr.lookup("r3")
    assert reused not in hit.block_ids, f"lookup served block {reused}, now r2's, as r1's prefix"
    counters = eng.mgr.stats().counters
    assert counters.corruption_detections + counters.hash_collisions == 1  # the refusal is seen


# -- f. salt left out of the hash ---------------------------------------------------------------


def test_f_cross_tenant_share_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    original = manager_module.encode_extra_keys
    # BUG: the salt (last extra key) never reaches the hash.
    monkeypatch.setattr(manager_module, "encode_extra_keys", lambda *keys: original(*keys[:-1]))
    eng = Engine(10)
    steps = two_tenants(eng)
    assert run(eng, steps[:1]) is None
    tenant_a_prefix = eng.table("a1")[:2]

    findings = caught(eng, steps[1:], within=1)
    assert named(findings.violations(ViolationKind.CROSS_TENANT_SHARE)) == {
        (b, "b1") for b in tenant_a_prefix
    }


def test_f_tenants_without_the_bug_get_no_cross_tenant_hit() -> None:
    eng = Engine(10)
    steps = two_tenants(eng)
    assert run(eng, steps[:1]) is None
    eng.add("b1", P2, salt="tenant-b")
    assert eng.mgr.lookup("b1").num_tokens == 0
    eng.add("a2", P2, salt="tenant-a")
    assert eng.mgr.lookup("a2").block_ids == tuple(eng.table("a1")[:2])


# -- g. hits touched before the capacity check ------------------------------------------------


def test_g_touch_before_capacity_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.allocate_slots

    def allocate_slots(self: KVCacheManager, request_id: str, num_new_tokens: int, prefix_hit=None):
        hits = []
        if prefix_hit is not None and prefix_hit.block_ids and not self.block_table(request_id):
            hits = [self.pool.blocks[i] for i in prefix_hit.block_ids]
            self.pool.touch(hits)  # BUG: the hit is taken before we know the rest fits
        out = original(self, request_id, num_new_tokens, prefix_hit)
        if out is not None:
            for block in hits:
                block.ref_cnt -= 1  # the success path is correct: one reference per hit block
        return out

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    eng = Engine(8)
    steps = refused_admission(eng)
    assert run(eng, steps[:3]) is None
    eng.mgr.add_request("probe", [*SYS, 0])
    hit_blocks = list(eng.mgr.lookup("probe").block_ids)
    eng.mgr.free("probe")
    assert len(hit_blocks) == 2

    findings = caught(eng, steps[3:], within=1)
    assert {v.block_id for v in findings.violations(ViolationKind.REFCOUNT_MISMATCH)} == set(
        hit_blocks
    )
    assert len(findings.all_or_nothing) == 1
    assert all(f"({b}, 0, 1)" in findings.all_or_nothing[0] for b in hit_blocks)


# -- h. a hash published before the KV is written -------------------------------------------


def test_h_hash_published_before_kv_written_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    original = KVCacheManager.commit

    def commit(self: KVCacheManager, request_id: str, num_computed_tokens: int) -> None:
        record = self.ledger.get(request_id)
        if record is None:
            return original(self, request_id, num_computed_tokens)
        # BUG: every allocated full block is published, written or not.
        upto = min(len(record.block_table) * self.block_size, len(record.token_ids))
        original(self, request_id, upto)
        record.num_computed_tokens = num_computed_tokens

    monkeypatch.setattr(KVCacheManager, "commit", commit)
    eng = Engine(10)
    findings = caught(eng, chunked_prefill_allocated_ahead(eng), within=1)
    unwritten = eng.table("r1")[1:3]  # tokens 4..11: slots allocated, KV not yet written
    assert named(findings.violations(ViolationKind.STALE_HASH)) == {(b, "r1") for b in unwritten}
    assert all("uncommitted tokens" in v.message for v in findings.report.violations)


# -- i. (extra) a block reused without a new epoch, under a stashed prefix hit -------------------


def _allocate_keeping_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.allocate

    def allocate_keeping_epochs(self: BlockPool, num_blocks: int, *args, **kwargs):
        epochs = [b.epoch for b in self.blocks]
        out = original(self, num_blocks, *args, **kwargs)
        for block in out or ():
            block.epoch = epochs[block.block_id]  # BUG: the block is handed on at its old epoch
        return out

    monkeypatch.setattr(BlockPool, "allocate", allocate_keeping_epochs)


def test_i_stale_hit_is_refused_even_when_reuse_keeps_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r3's admission reuses a block of r2's stashed hit without bumping its epoch, so the epochs
    still match; allocate_slots must still refuse the hit (it re-checks the hashes) and change
    nothing, and r2's fresh lookup must stop short of r3's block."""
    _allocate_keeping_epochs(monkeypatch)
    eng = Engine(10)
    stash: dict[str, PrefixHit] = {}
    steps = stashed_hit(eng, stash)
    assert run(eng, steps[:-1]) is None
    r3_unwritten = eng.table("r3")[-1]  # r3 committed 16 of 17 tokens: its last block is unwritten
    assert r3_unwritten in stash["r2"].block_ids
    assert [eng.mgr.pool.blocks[b].epoch for b in stash["r2"].block_ids] == list(
        stash["r2"].epochs
    ), "the planted bug should leave the epochs looking fresh"

    before = snapshot(eng.mgr)
    with pytest.raises(ValueError, match="stale prefix hit"):
        steps[-1]()
    assert diff_snapshots(before, snapshot(eng.mgr)) == ""
    assert eng.check().ok
    assert r3_unwritten not in eng.mgr.lookup("r2").block_ids
