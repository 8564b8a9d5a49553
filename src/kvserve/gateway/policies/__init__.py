"""Pure routing policies: which worker gets a request (no HTTP, asyncio or clock).

`make_policy(name, **options)` builds one of `POLICIES`: round_robin, least_load (power of two
choices), prefix_hash (rendezvous hashing with bounded load), cache_aware (approximate prefix
index, continuous score) and precise (exact index from KV events). The gateway proxy and the
fleet simulator both drive them through `RoutingPolicy`.
"""

from kvserve.gateway.policies.base import (
    Branch,
    CapacityAware,
    NoHealthyWorker,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
    healthy_workers,
)
from kvserve.gateway.policies.block_index import BlockIndex
from kvserve.gateway.policies.cache_aware import CacheAwarePolicy
from kvserve.gateway.policies.disaggregated import DisaggregatedRouter
from kvserve.gateway.policies.factory import (
    POLICIES,
    POLICY_NAMES,
    make_policy,
    parse_policy_options,
    split_policy_spec,
)
from kvserve.gateway.policies.least_load import LeastLoadPolicy
from kvserve.gateway.policies.precise import PrecisePolicy
from kvserve.gateway.policies.prefix_hash import PrefixHashPolicy, load_bound
from kvserve.gateway.policies.rendezvous import (
    rendezvous_key,
    rendezvous_order,
    rendezvous_weight,
)
from kvserve.gateway.policies.round_robin import RoundRobinPolicy

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "BlockIndex",
    "Branch",
    "CacheAwarePolicy",
    "CapacityAware",
    "DisaggregatedRouter",
    "LeastLoadPolicy",
    "NoHealthyWorker",
    "PrecisePolicy",
    "PrefixHashPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "WorkerView",
    "healthy_workers",
    "load_bound",
    "make_policy",
    "parse_policy_options",
    "rendezvous_key",
    "rendezvous_order",
    "rendezvous_weight",
    "split_policy_spec",
]
