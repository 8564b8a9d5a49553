"""Pure routing: which worker gets a request (no HTTP, asyncio or clock).

One pipeline (`pipeline.py`): filters -> order -> weighted scorers -> picker. `make_policy(name,
**options)` builds one of `POLICIES`, each a named configuration of it: round_robin, least_load
(power of two choices), prefix_hash (rendezvous hashing with bounded load), cache_aware
(approximate prefix index, continuous score), precise (exact index from KV events) and
lora_affinity (where a request's LoRA adapter is loaded, and load: for comparison);
`DisaggregatedRouter` puts a prefill and a decode pipeline behind role filters. The gateway
proxy, the Endpoint Picker and the fleet simulator all drive them through
`core.lifecycle.Dispatch`.
"""

from kvserve.gateway.core.pipeline.adapter_affinity import (
    DEFAULT_ADAPTER_WEIGHT,
    AdapterAffinity,
)
from kvserve.gateway.core.pipeline.base import (
    Branch,
    CapacityAware,
    NoHealthyWorker,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
    healthy_workers,
)
from kvserve.gateway.core.pipeline.block_index import BlockIndex
from kvserve.gateway.core.pipeline.cache_aware import CacheAwarePolicy
from kvserve.gateway.core.pipeline.disaggregated import DisaggregatedRouter
from kvserve.gateway.core.pipeline.factory import (
    POLICIES,
    POLICY_NAMES,
    make_policy,
    parse_policy_options,
    split_policy_spec,
)
from kvserve.gateway.core.pipeline.filters import Healthy, Role
from kvserve.gateway.core.pipeline.indexes import ApproxIndex, ExactIndex
from kvserve.gateway.core.pipeline.least_load import LeastLoadPolicy
from kvserve.gateway.core.pipeline.lora_affinity import LoRAAffinityPolicy
from kvserve.gateway.core.pipeline.pickers import BestScore, BoundedLoad, Rotation, TwoChoices
from kvserve.gateway.core.pipeline.pipeline import (
    Filter,
    Order,
    Picker,
    Pipeline,
    PrefixIndex,
    Scorer,
)
from kvserve.gateway.core.pipeline.precise import PrecisePolicy
from kvserve.gateway.core.pipeline.prefix_hash import PrefixHashPolicy, load_bound
from kvserve.gateway.core.pipeline.rendezvous import (
    RendezvousOrder,
    rendezvous_key,
    rendezvous_order,
    rendezvous_weight,
)
from kvserve.gateway.core.pipeline.round_robin import RoundRobinPolicy
from kvserve.gateway.core.pipeline.scorers import Backlog, Footprint, Load, PrefixHits

__all__ = [
    "DEFAULT_ADAPTER_WEIGHT",
    "POLICIES",
    "POLICY_NAMES",
    "AdapterAffinity",
    "ApproxIndex",
    "Backlog",
    "BestScore",
    "BlockIndex",
    "BoundedLoad",
    "Branch",
    "CacheAwarePolicy",
    "CapacityAware",
    "DisaggregatedRouter",
    "ExactIndex",
    "Filter",
    "Footprint",
    "Healthy",
    "LeastLoadPolicy",
    "LoRAAffinityPolicy",
    "Load",
    "NoHealthyWorker",
    "Order",
    "Picker",
    "Pipeline",
    "PrecisePolicy",
    "PrefixHashPolicy",
    "PrefixHits",
    "PrefixIndex",
    "RendezvousOrder",
    "Role",
    "Rotation",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "Scorer",
    "TwoChoices",
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
