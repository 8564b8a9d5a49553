"""The engine-like scenarios the planted bugs are run under, and how a test starts one.

Each scenario is a few engine steps (a few requests, shared prefixes, memory pressure) whose
bug-free run passes every check, so a planted-bug test can only fail for the planted reason.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest

from kvserve.kvcache import FreeReason, PrefixHit
from tests.kvcache.planted_harness import Engine, Step, diff_snapshots, run_clean, snapshot

SYS = list(range(1, 9))  # a 2-block system prompt every chat of a tenant starts with
P1 = [*SYS, 11, 12, 13]  # 11 tokens: 2 full blocks + 3
P2 = [*SYS, 21, 22, 23, 24, 25]  # 13 tokens: 3 full blocks + 1
OTHER = list(range(31, 44))  # 13 tokens, shares nothing
LONG = list(range(51, 71))  # 20 tokens, shares nothing


def held_eviction(eng: Engine) -> list[Step]:
    """r1 decodes while r2's admission drives the pool to its last free block."""
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: eng.decode("r1", 14),
        lambda: (eng.add("r2", OTHER), eng.admit("r2")),
        lambda: (eng.decode("r1", 15), eng.decode("r2", 44)),
        lambda: (eng.finish("r1"), eng.finish("r2")),
    ]


def abort_mid_prefill(eng: Engine, forget_r2: bool = False) -> list[Step]:
    """r2 shares r1's system prompt and is aborted mid chunked prefill (or, with `forget_r2`,
    dropped by the engine without a free); then r1 finishes (idle)."""
    return [
        lambda: (eng.add("r1", P1), eng.admit("r1")),
        lambda: (eng.add("r2", P2), eng.admit("r2", upto=12)),
        (lambda: eng.forget("r2")) if forget_r2 else (lambda: eng.finish("r2", FreeReason.ABORTED)),
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


def stashed_hit(eng: Engine, stash: dict[str, PrefixHit] | None = None) -> list[Step]:
    """The engine looks up r2 early in the step and allocates it after r3 was admitted (and
    evicted a block of r2's hit) and r4 finished. The cache must refuse the now-stale hit; its
    last step raises rather than passing the checks."""
    stash = {} if stash is None else stash

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


# name -> (num_blocks, scenario): the pool size puts each scenario under memory pressure.
SCENARIOS: dict[str, tuple[int, Callable[..., list[Step]]]] = {
    "held_eviction": (8, held_eviction),
    "abort_mid_prefill": (10, abort_mid_prefill),
    "shared_prefix": (10, shared_prefix),
    "shared_prefix_r1_first": (10, partial(shared_prefix, r1_finishes_first=True)),
    "reuse_after_finish": (6, reuse_after_finish),
    "two_tenants": (10, two_tenants),
    "refused_admission": (8, refused_admission),
    "chunked_prefill_allocated_ahead": (10, chunked_prefill_allocated_ahead),
    "stashed_hit": (10, stashed_hit),
}


def play(name: str, upto: int, **options: object) -> tuple[Engine, list[Step]]:
    """A fresh engine for scenario `name` with its steps before `upto` run and checked clean;
    returns the engine and the steps left."""
    num_blocks, scenario = SCENARIOS[name]
    eng = Engine(num_blocks)
    steps = scenario(eng, **options)
    run_clean(eng, steps[:upto])
    return eng, steps[upto:]


def assert_clean_without_the_bug(name: str) -> None:
    """The unpatched scenario passes every check, ends idle and frees every block."""
    eng, rest = play(name, 0)
    run_clean(eng, rest)
    assert not eng.live, f"still live: {eng.live}"
    idle = eng.mgr.check_idle()
    assert idle.ok, idle.describe()
    num_free, num_blocks = eng.mgr.stats().num_free_blocks, SCENARIOS[name][0]
    assert num_free == num_blocks, f"{num_free} of {num_blocks} blocks free"


def assert_stale_hit_refused(eng: Engine, allocate_with_stale_hit: Step) -> None:
    """Allocating with a stale hit raises, changes nothing and leaves every check passing."""
    before = snapshot(eng.mgr)
    with pytest.raises(ValueError, match="stale prefix hit"):
        allocate_with_stale_hit()
    delta = diff_snapshots(before, snapshot(eng.mgr))
    assert delta == "", f"the refusal changed {delta}"
    findings = eng.check()
    assert findings.ok, findings.describe()
