"""The prefill backlog in the cache-versus-load score: tokens of prefill queued on a worker, which
a count of requests cannot see (a cold 3k-token prefill and a 50-token cache hit are one request
each)."""

from __future__ import annotations

import pytest

from kvserve.gateway.core.pipeline import (
    Branch,
    CacheAwarePolicy,
    PrecisePolicy,
    RouteRequest,
    WorkerView,
    make_policy,
    parse_policy_options,
)
from tests.gateway.helpers import request

PROMPT = "".join(f"{i:08d}" for i in range(40))  # 40 blocks of 8 characters, 2 tokens a block


def busy(backlog: dict[str, int]) -> list[WorkerView]:
    """Idle workers (no requests counted) with the given prefill backlogs in tokens."""
    return [WorkerView(wid, True, 0, prefill_backlog_tokens=b) for wid, b in backlog.items()]


def test_a_new_prefix_avoids_a_worker_busy_with_a_cold_prefill() -> None:
    policy = CacheAwarePolicy(backlog_weight=0.5, cold_placement="footprint")  # weight 16
    for tenant in range(4):  # "a" holds four tenants' prefixes, "b" none: "b" is the emptier
        policy.observe(request(PROMPT, f"old-{tenant}"), "a")
    new = request(PROMPT, "new-tenant")
    assert policy.route(new, busy({"a": 0, "b": 0})).worker_id == "b"
    assert policy.route(new, busy({"a": 0, "b": 40})).worker_id == "b"  # 0.5 * 20 < 16
    decision = policy.route(new, busy({"a": 0, "b": 80}))  # 0.5 * 40 > 16
    assert (decision.worker_id, decision.branch) == ("a", Branch.LEAST_LOAD)
    # Without the term, the request count alone cannot see the backlog.
    blind = CacheAwarePolicy(backlog_weight=0.0, cold_placement="footprint")
    for tenant in range(4):
        blind.observe(request(PROMPT, f"old-{tenant}"), "a")
    assert blind.route(new, busy({"a": 0, "b": 10_000})).worker_id == "b"


def test_both_index_policies_weigh_backlog_by_default() -> None:
    assert 0 < CacheAwarePolicy().backlog_weight == PrecisePolicy().backlog_weight < 1


@pytest.mark.parametrize(("matched", "weight", "credit"),
                         [(5, 0.25, 1.0), (12, 0.5, 1.0), (30, 1.0, 1.0), (7, 0.25, 3.0),
                          (9, 0.5, 0.25)])
def test_a_cached_prefix_is_left_only_for_a_backlog_of_its_size_over_the_weight(
    matched: int, weight: float, credit: float
) -> None:
    """Whatever a cached block is worth against a request of load, a token of backlog costs
    `weight` of a cached token."""
    policy = CacheAwarePolicy(footprint_weight=0.0, backlog_weight=weight, block_credit=credit)
    policy.observe(request(PROMPT[: 8 * matched]), "a")
    req = request(PROMPT)
    margin = round(matched * req.block_tokens / weight)  # backlog tokens the credit is worth
    choices = [policy.route(req, busy({"a": backlog, "b": 0})).worker_id
               for backlog in range(0, 2 * margin + 1)]
    switch = choices.index("b")
    assert choices == ["a"] * switch + ["b"] * (len(choices) - switch)
    assert switch in (margin, margin + 1)  # at exactly the margin, a tie: rendezvous order
    # Only the difference counts: the same with "b" busy too.
    both = [policy.route(req, busy({"a": margin + 100 + d, "b": 100})).worker_id
            for d in (-1, 1)]
    assert both == ["a", "b"]


def test_precise_weighs_backlog_in_its_own_block_size() -> None:
    """Exact keys have 16-token blocks: the same tokens of backlog against the same tokens of
    cached prefix give the same answer as with any block size."""
    policy = PrecisePolicy(backlog_weight=0.5)
    hashes = tuple(bytes([i]) * 32 for i in range(10))
    policy.apply_events("a", stored=hashes)
    req = RouteRequest(hashes, "t", num_tokens=200, block_tokens=16)  # 160 tokens cached on a
    assert policy.route(req, busy({"a": 319, "b": 0})).worker_id == "a"  # 320: a tie
    assert policy.route(req, busy({"a": 336, "b": 0})).worker_id == "b"


def test_uncached_tokens_and_the_value_checks() -> None:
    req = RouteRequest((b"x" * 32,) * 3, "t", num_tokens=50, block_tokens=16)
    assert [req.uncached_tokens(m) for m in (0, 1, 3, 9)] == [50, 34, 2, 0]
    for bad in ({"num_tokens": -1}, {"block_tokens": 0}):
        with pytest.raises(ValueError, match="block_tokens"):
            RouteRequest((), **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token counts"):
        WorkerView("w", True, 0, prefill_backlog_tokens=-1)
    for name in ("cache_aware", "precise"):
        with pytest.raises(ValueError, match="backlog_weight"):
            make_policy(name, backlog_weight=-0.5)
        with pytest.raises(ValueError, match="backlog_weight"):
            make_policy(name, backlog_weight=float("inf"))


def test_policy_options_parse_into_typed_values() -> None:
    options = parse_policy_options(["backlog_weight=0.25", "max-blocks-per-worker=4096",
                                    "flag=true", "name=x=y"])
    assert options == {"backlog_weight": 0.25, "max_blocks_per_worker": 4096, "flag": True,
                       "name": "x=y"}
    assert make_policy("cache_aware", **parse_policy_options(["backlog_weight=0"])) \
        .backlog_weight == 0.0  # type: ignore[attr-defined]
    for bad in ("backlog_weight", "=3"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_policy_options([bad])
    with pytest.raises(ValueError, match="has no option nope; its options are"):
        make_policy("precise", **parse_policy_options(["nope=1"]))


@pytest.mark.parametrize(("flags", "message"), [
    (["--policy", "cache_aware", "--policy-option", "backlog_weight=-1"],
     "backlog_weight must be >= 0"),
    (["--policy", "precise", "--worker-kv-events", "tcp://127.0.0.1:5557"],
     "a source for every worker must be one each worker binds, tcp://*:PORT"),
    (["--policy", "precise", "--worker-kv-events", "tcp://*:1",
      "--worker-kv-events", "tcp://*:2"], "every worker's source: give it once"),
])
def test_the_gateway_command_refuses_a_bad_routing_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvserve.cli import main

    assert main(["gateway", "--worker", "http://127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err
