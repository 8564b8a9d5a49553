"""kvserve.sim — a discrete-event fleet simulator: clients → gateway policy → N workers.

Each simulated worker runs the engine's own `EngineCore` and `Scheduler` over a real
`kvserve.kvcache.KVCacheManager` (hits, evictions and preemptions are exact), with a simulated
model executor that prices each step; the gateway is the real pure core
(`kvserve.gateway.core`: pipeline and dispatch lifecycle) fed scraped, stale load signals; time
comes from a cost model fitted to measurements (`profiles`). Imports only kvserve.engine,
kvserve.kvcache, kvserve.workload and the gateway's pure core: never the model, runtime or
server layers, nor torch.
"""

from kvserve.sim.client import ClientConfig, Outcome
from kvserve.sim.costmodel import CostProfile, StepShape
from kvserve.sim.fleet import SIMULATED_POLICIES, FleetSimulator, SimConfig
from kvserve.sim.gateway import Backpressure
from kvserve.sim.metrics import SimResult
from kvserve.sim.profiles import BUILTIN, load_profile
from kvserve.sim.runner import SimTask, run_tasks
from kvserve.sim.worker import WorkerConfig
from kvserve.sim.workload import MULTI_TENANT, RouteKeys, Workload, load_workload

__all__ = [
    "BUILTIN",
    "MULTI_TENANT",
    "SIMULATED_POLICIES",
    "Backpressure",
    "ClientConfig",
    "CostProfile",
    "FleetSimulator",
    "Outcome",
    "RouteKeys",
    "SimConfig",
    "SimResult",
    "SimTask",
    "StepShape",
    "WorkerConfig",
    "Workload",
    "load_profile",
    "load_workload",
    "run_tasks",
]
