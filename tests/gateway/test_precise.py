"""precise: an exact index fed by KV events, matching what a real kvserve cache publishes."""

from __future__ import annotations

from kvserve.gateway.core.pipeline import Branch, PrecisePolicy, RouteRequest
from kvserve.gateway.core.prefix import RouteKey
from tests.gateway.helpers import views

BLOCK = 4
TOKENS = list(range(1000, 1040))  # 10 blocks


def key(tokens: list[int], tenant: str | None = "t") -> RouteRequest:
    return RouteRequest.from_key(RouteKey.from_token_ids(tokens, tenant, block_tokens=BLOCK))


def test_stored_removed_and_cleared_events_drive_the_match() -> None:
    policy = PrecisePolicy(load_weight=0.5, max_pending_blocks_per_worker=0)
    req = key(TOKENS)
    fleet = views({"a": 1, "b": 0})
    assert policy.route(req, fleet).branch == Branch.LEAST_LOAD
    policy.apply_events("a", stored=req.prefix_hashes)
    hit = policy.route(req, fleet)
    assert (hit.worker_id, hit.branch, hit.predicted_hit_blocks) == ("a", Branch.PRECISE_HIT, 10)
    policy.apply_events("a", removed=req.prefix_hashes[6:])  # evicted from the tail
    assert policy.route(req, fleet).predicted_hit_blocks == 6
    policy.apply_events("b", stored=req.prefix_hashes[:8])
    assert policy.route(req, fleet).worker_id == "b"  # more blocks and less load
    policy.apply_events("b", cleared=True)
    assert policy.num_cached_blocks("b") == 0
    assert policy.route(req, fleet).worker_id == "a"
    policy.remove_worker("a")
    assert policy.route(req, fleet).branch == Branch.LEAST_LOAD


def test_an_index_fed_by_real_kvcache_events_predicts_the_workers_hits() -> None:
    from kvserve.kvcache import BlockRemoved, BlockStored, KVCacheManager

    manager = KVCacheManager(12, BLOCK, enable_events=True, model_id="demo")
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)

    def sync() -> None:
        for event in manager.drain_events():
            if isinstance(event, BlockStored):
                policy.apply_events("w0", stored=event.block_hashes)
            elif isinstance(event, BlockRemoved):
                policy.apply_events("w0", removed=event.block_hashes)
            else:
                policy.apply_events("w0", cleared=True)

    def run(request_id: str, tokens: list[int], salt: str) -> None:
        manager.add_request(request_id, tokens, cache_salt=salt)
        assert manager.allocate_slots(request_id, len(tokens)) is not None
        manager.commit(request_id, len(tokens))
        manager.free(request_id)
        sync()

    fleet = views({"w0": 0, "w1": 0})
    exact = RouteRequest.from_key(
        RouteKey.from_token_ids(TOKENS + [7], "acme", block_tokens=BLOCK, model_id="demo")
    )
    run("r1", TOKENS, "acme")
    assert policy.route(exact, fleet).predicted_hit_blocks == 10
    manager.add_request("probe", TOKENS + [7], cache_salt="acme")
    assert manager.lookup("probe").num_tokens == 10 * BLOCK  # the worker agrees
    manager.free("probe")
    # Another tenant's identical prompt matches nothing; a wrong model id matches nothing.
    other = RouteKey.from_token_ids(TOKENS, "globex", block_tokens=BLOCK, model_id="demo")
    assert policy.route(RouteRequest.from_key(other), fleet).predicted_hit_blocks == 0
    wrong = RouteKey.from_token_ids(TOKENS, "acme", block_tokens=BLOCK, model_id="other")
    assert policy.route(RouteRequest.from_key(wrong), fleet).predicted_hit_blocks == 0
    # A new prompt evicts some of the old chain; the index follows, tail first.
    run("r2", list(range(5000, 5024)), "acme")
    assert policy.route(exact, fleet).predicted_hit_blocks == 6
    assert manager.reset_prefix_cache()
    sync()
    assert policy.num_cached_blocks("w0") == 0


def test_a_burst_sticks_to_one_worker_before_its_events_arrive() -> None:
    policy = PrecisePolicy()
    req = key(TOKENS)
    fleet = views({"a": 0, "b": 0, "c": 0})
    first = policy.route(req, fleet)
    policy.observe(req, first.worker_id)
    loads = {w: 0 for w in "abc"} | {first.worker_id: 1}
    second = policy.route(req, views(loads))
    assert second.worker_id == first.worker_id and second.predicted_hit_blocks == 10
    policy.apply_events(first.worker_id, stored=req.prefix_hashes[:4])  # part confirmed
    assert policy.route(req, views(loads)).predicted_hit_blocks == 10  # cached head + pending tail
    policy.apply_events(first.worker_id, removed=req.prefix_hashes[2:])  # gone, pending too
    assert policy.route(req, fleet).predicted_hit_blocks == 2
    without = PrecisePolicy(max_pending_blocks_per_worker=0)
    without.observe(req, first.worker_id)
    assert without.route(req, views(loads)).predicted_hit_blocks == 0
