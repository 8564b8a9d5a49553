"""Routing that knows LoRA adapters: the request's adapter, prefix keys keyed by adapter (text
keys, and the exact index from vLLM's and kvserve's KV events), and adapter affinity read from
`vllm:lora_requests_info` as a vLLM worker exports it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.gateway.core.adapters import (
    AdapterCatalog,
    AdapterState,
    parse_tenant_adapters,
)
from kvserve.gateway.core.pipeline import (
    AdapterAffinity,
    CacheAwarePolicy,
    PrecisePolicy,
    RouteRequest,
    WorkerView,
    make_policy,
)
from kvserve.gateway.core.pipeline.adapter_affinity import AdapterOrder
from kvserve.gateway.core.pipeline.rendezvous import RendezvousOrder
from kvserve.gateway.core.prefix import RouteKey
from kvserve.gateway.core.prepare import prepare_request
from kvserve.gateway.core.tenancy import Tenancy
from kvserve.gateway.fleet.event_index import WorkerIndexFeed
from kvserve.gateway.fleet.scraper import apply_metrics, listed_adapters, read_adapter_state
from kvserve.gateway.fleet.worker_pool import WorkerState
from kvserve.kvevents.wire import StoredBlocks, adapter_extra_key, adapter_name_digest

BS = 4
PROMPT = list(range(300, 300 + 3 * BS))
LORA_INFO = Path(__file__).parents[1] / "data" / "vllm_lora" / "lora_requests_info.prom"


def worker_pages() -> dict[str, str]:
    """The fixture's page of each worker (sections start with `## NAME`)."""
    pages: dict[str, list[str]] = {}
    name = None
    for line in LORA_INFO.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            pages[name] = []
        elif name is not None:
            pages[name].append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in pages.items()}


def scraped_views() -> list[WorkerView]:
    views = []
    for name, page in worker_pages().items():
        state = WorkerState(name)
        apply_metrics(state, page)
        views.append(state.view(now=0.0))
    return views


def test_tenant_adapter_specs_parse_and_malformed_ones_say_how_to_fix() -> None:
    assert parse_tenant_adapters(["fin=finance", " ops = sql "]) == {"fin": "finance",
                                                                      "ops": "sql"}
    for bad in ("fin", "=finance", "fin=", "fin finance"):
        with pytest.raises(ValueError, match="TENANT=ADAPTER"):
            parse_tenant_adapters([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_tenant_adapters(["fin=finance", "fin=legal"])


def test_the_adapter_is_the_listed_model_else_the_tenants_else_none() -> None:
    catalog = AdapterCatalog({"fin": "finance"})
    catalog.set_listed("w", listed_adapters({"data": [
        {"id": "base-model", "parent": None}, {"id": "legal", "parent": "base-model"},
        {"id": "finance", "parent": "base-model"}]}))
    legal = catalog.resolve("legal", "fin")  # the request's model wins over the tenant's
    assert legal is not None and (legal.name, legal.base_model) == ("legal", "base-model")
    assert legal.digest == adapter_name_digest("legal")
    finance = catalog.resolve("base-model", "fin")
    assert finance is not None and (finance.name, finance.base_model) == ("finance",
                                                                          "base-model")
    assert catalog.resolve("base-model", "other") is None
    assert catalog.resolve("unlisted", None) is None
    catalog.forget_worker("w")
    assert catalog.resolve("legal", None) is None


def test_a_text_prefix_cached_under_adapter_a_is_no_hit_for_b_or_the_base() -> None:
    text = "a long shared system prompt " * 40
    policy = CacheAwarePolicy()
    views = [WorkerView("w0", True, 0), WorkerView("w1", True, 0)]
    under_a = RouteRequest.from_key(RouteKey.from_text(text, "t", adapter="A"))
    policy.observe(under_a, "w1")
    blocks = len(under_a.prefix_hashes)
    assert blocks > 2
    assert policy.route(under_a, views).predicted_hit_blocks == blocks
    for adapter in ("B", None):
        other = RouteRequest.from_key(RouteKey.from_text(text, "t", adapter=adapter))
        assert not set(other.prefix_hashes) & set(under_a.prefix_hashes)
        assert policy.route(other, views).predicted_hit_blocks == 0
    # The base model's keys are those from before adapters existed.
    assert RouteKey.from_text(text, "t").prefix_hashes == RouteKey.from_text(
        text, "t", adapter=None).prefix_hashes


def exact_hits(policy: PrecisePolicy, catalog: AdapterCatalog, model: str) -> int:
    adapter = catalog.resolve(model, None)
    key = RouteKey.from_token_ids(
        PROMPT, "salt", block_tokens=BS, model_id=adapter.base_model if adapter else "base",
        adapter_digest=adapter.digest if adapter else None,
        adapter=adapter.name if adapter else None)
    views = [WorkerView("w", True, 0), WorkerView("v", True, 0)]
    decision = policy.route(RouteRequest.from_key(key), views)
    return decision.predicted_hit_blocks if decision.worker_id == "w" else 0


def lora_catalog() -> AdapterCatalog:
    catalog = AdapterCatalog()
    catalog.set_listed("w", {"A": "base", "B": "base"})
    return catalog


def test_vllm_events_of_adapter_a_hit_for_a_and_not_for_b_or_the_base() -> None:
    catalog = lora_catalog()
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, "w", "base", BS, catalog)
    # vLLM: the adapter's name first in the first block's extra keys, then the salt.
    feed.apply([StoredBlocks((11, 12, 13), None, tuple(PROMPT), BS, "GPU", "A",
                             (("A", "salt"), None, None))])
    assert exact_hits(policy, catalog, "A") == 3
    assert exact_hits(policy, catalog, "B") == 0
    assert exact_hits(policy, catalog, "base") == 0


def test_kvserve_events_key_by_the_digest_and_teach_it_to_the_catalog() -> None:
    catalog = lora_catalog()
    policy = PrecisePolicy(max_pending_blocks_per_worker=0)
    feed = WorkerIndexFeed(policy, "w", "base", BS, catalog)
    digest = bytes(range(32))  # the sha256 of the adapter's weights, as kvserve sends it
    assert exact_hits(policy, catalog, "A") == 0
    feed.apply([StoredBlocks((21, 22, 23), None, tuple(PROMPT), BS, "GPU", "A",
                             ((adapter_extra_key(digest), "salt"), None, None))])
    assert catalog.digest_for("A") == digest
    assert exact_hits(policy, catalog, "A") == 3
    assert exact_hits(policy, catalog, "B") == 0
    assert exact_hits(policy, catalog, "base") == 0


def test_prepare_sends_the_tenants_adapter_and_keys_the_request_by_it() -> None:
    tenancy = Tenancy.from_options("s" * 32, trust_header=True)
    catalog = AdapterCatalog({"fin": "finance"})
    body = json.dumps({"model": "base-model", "prompt": "x" * 1024}).encode()

    def prepare(tenant: str) -> tuple[str, RouteRequest]:
        prepared = prepare_request("/v1/completions", body, {"x-tenant-id": tenant}, tenancy,
                                   adapters=catalog)
        return prepared.body["model"], prepared.route

    model, route = prepare("fin")
    assert (model, route.adapter) == ("finance", "finance")
    base_model, base_route = prepare("ops")
    assert (base_model, base_route.adapter) == ("base-model", None)
    unmapped = prepare_request("/v1/completions", body, {"x-tenant-id": "fin"}, tenancy).route
    assert unmapped.adapter is None and unmapped.prefix_hashes != route.prefix_hashes


def test_the_latest_lora_requests_info_sample_is_each_workers_state() -> None:
    states = {name: read_adapter_state(page) for name, page in worker_pages().items()}
    assert states["w-active"] == AdapterState(2, frozenset({"finance"}))
    assert states["w-free"] == AdapterState(2, frozenset({"legal"}))
    assert states["w-waiting"] == AdapterState(2, frozenset({"legal", "sql"}),
                                               frozenset({"finance"}))
    assert read_adapter_state("vllm:num_requests_running 1\n") is None
    assert AdapterState.from_labels({"max_lora": "0"}) is None


def test_affinity_orders_active_then_free_slot_then_waiting_then_elsewhere() -> None:
    views = scraped_views()
    assert [v.worker_id for v in views] == ["w-active", "w-free", "w-waiting", "w-busy"]
    finance = RouteRequest((), "t", 10, adapter="finance")
    assert AdapterAffinity(10.0).score(finance, views, {}) == [10.0, 8.0, 6.0, 0.0]
    assert AdapterAffinity(10.0).score(RouteRequest((), "t", 10), views, {}) == [0.0] * 4
    ranked = make_policy("lora_affinity").route(finance, views).ranked
    assert ranked == ("w-active", "w-free", "w-waiting", "w-busy")
    # Weighed against load: two more requests in flight outweigh 0.2 of a weight of 8.
    loaded = [WorkerView(v.worker_id, True, 2 if v.worker_id == "w-active" else 0,
                         adapters=v.adapters) for v in views]
    assert make_policy("lora_affinity").route(finance, loaded).worker_id == "w-free"


def test_cache_aware_weighs_adapter_affinity_against_prefix_hits() -> None:
    views = [v for v in scraped_views() if v.worker_id in ("w-active", "w-busy")]
    request = RouteRequest.from_key(RouteKey.from_text("p" * 2048, "t", adapter="finance"))
    blocks = len(request.prefix_hashes)  # 8 blocks of 256 characters
    for weight, expected in ((0.0, "w-busy"), (4.0, "w-busy"), (16.0, "w-active")):
        policy = CacheAwarePolicy(adapter_weight=weight)
        policy.observe(request, "w-busy")  # the prefix is cached where slots run others
        assert policy.route(request, views).worker_id == expected, (weight, blocks)


def test_a_prefix_nobody_holds_goes_where_its_adapter_runs() -> None:
    views = scraped_views()
    for text in ("first tenant " * 100, "second tenant " * 100):
        request = RouteRequest.from_key(RouteKey.from_text(text, text[:5], adapter="finance"))
        assert CacheAwarePolicy().route(request, views).worker_id == "w-active"
    # Without scraped adapters, an adapter's prefixes share the adapter's rendezvous order.
    bare = [WorkerView(f"w{i}", True, 0) for i in range(8)]
    order = AdapterOrder(RendezvousOrder())
    firsts = {order.order(RouteRequest.from_key(RouteKey.from_text(
        f"tenant {i} " * 100, f"t{i}", adapter="legal")), bare)[0].worker_id
        for i in range(6)}
    assert len(firsts) == 1


def test_the_gateway_flag_maps_tenants_and_refuses_a_malformed_one() -> None:
    from kvserve.cli import build_parser
    from kvserve.gateway.cli.gateway import settings_from_args

    parser = build_parser()
    flags = ["gateway", "--worker", "http://w", "--salt-secret", "s" * 32]
    settings = settings_from_args(parser.parse_args(
        [*flags, "--tenant-adapter", "fin=finance", "--tenant-adapter", "ops=sql"]), ["http://w"])
    assert dict(settings.tenant_adapters) == {"fin": "finance", "ops": "sql"}
    with pytest.raises(ValueError, match="write TENANT=ADAPTER"):
        settings_from_args(parser.parse_args([*flags, "--tenant-adapter", "fin"]), ["http://w"])
