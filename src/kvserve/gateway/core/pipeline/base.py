"""The value objects every routing policy speaks, and the policy protocol.

Policies are pure: no HTTP, asyncio or clock. Anything that changes over time (health, loads, KV
events) arrives in the arguments, so the fleet simulator and every gateway replica run the very
same code and, given the same inputs, reach the same decisions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

from kvserve.gateway.core.adapters import AdapterState
from kvserve.gateway.core.prefix import DEFAULT_BLOCK_TOKENS, RouteKey


class NoHealthyWorker(RuntimeError):
    """No worker is healthy: the gateway answers 503 instead of routing."""

    def __init__(self, num_workers: int) -> None:
        super().__init__(
            f"no healthy worker among {num_workers} configured: every worker failed its health "
            "checks or was ejected; check the workers (GET /workers) and their /health"
        )
        self.num_workers = num_workers


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as a policy sees it at decision time; never mutated by a policy.

    `in_flight`: requests this gateway sent and that have not finished. `num_running`,
    `num_waiting`, `kv_usage` (0..1): the worker's own scraped metrics (its whole traffic,
    including other gateway replicas'). See `load`. `prefill_backlog_tokens`: prompt tokens of
    this gateway's requests that the worker has not answered yet (no first byte), less what the
    policy expected cached there: the prefill work ahead of a new request, in tokens, which a
    count of requests cannot tell apart (a cold 3k-token prefill and a 50-token cache hit are
    one request each). `adapters`: the worker's LoRA adapters as its last scraped
    `vllm:lora_requests_info` says (None: it serves none, or has not said).
    """

    worker_id: str
    healthy: bool
    in_flight: int
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefill_backlog_tokens: int = 0
    adapters: AdapterState | None = None

    def __post_init__(self) -> None:
        if min(self.in_flight, self.num_running, self.num_waiting,
               self.prefill_backlog_tokens) < 0:
            raise ValueError(f"worker {self.worker_id!r}: request and token counts must be >= 0")

    @property
    def load(self) -> int:
        """Outstanding work = this gateway's in-flight requests + the worker's waiting queue.
        Running requests are not added: this gateway's own are already in `in_flight`, and the
        waiting queue is what delays a new request's first token."""
        return self.in_flight + self.num_waiting


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy routes on: chained prefix block hashes (tenant salted and adapter keyed,
    see kvserve.gateway.core.prefix), the tenant, a prompt-token estimate, the tokens one block
    stands for (exact keys: the workers' block size; text keys: an estimate), and the LoRA
    adapter's name (None: the base model)."""

    prefix_hashes: tuple[bytes, ...]
    tenant: str | None = None
    num_tokens: int = 0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    adapter: str | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.block_tokens < 1:
            raise ValueError(f"num_tokens must be >= 0 and block_tokens >= 1, got "
                             f"{self.num_tokens} and {self.block_tokens}")

    @classmethod
    def from_key(cls, key: RouteKey) -> Self:
        """The request for a prefix key."""
        return cls(key.prefix_hashes, key.tenant, key.num_tokens, key.block_tokens, key.adapter)

    def uncached_tokens(self, matched_blocks: int) -> int:
        """Prompt tokens left to prefill on a worker that holds `matched_blocks` of the prefix."""
        return max(0, self.num_tokens - matched_blocks * self.block_tokens)


class Branch(enum.StrEnum):
    """Why a worker was chosen (a metrics label)."""

    AFFINITY = "affinity"  # the prefix's first choice (rendezvous top / best cached match)
    PRECISE_HIT = "precise_hit"  # the worker whose exact KV index holds the longest prefix
    SPILL = "spill"  # the first choice was over its load bound, or its load outweighed its credit
    LEAST_LOAD = "least_load"  # no prefix signal: chosen by load
    ROUND_ROBIN = "round_robin"
    NO_HEALTHY = "no_healthy"  # label only: route() raised NoHealthyWorker, no decision exists


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen worker, why, the fallback order for retries (all healthy workers, the chosen
    one first), and how many prefix blocks the policy expects it to have cached (0 when the
    policy keeps no index). `prefill`: in disaggregated routing, the worker that computes the
    prompt's KV for the chosen (decode) worker, with its own decision."""

    worker_id: str
    branch: Branch
    ranked: tuple[str, ...]
    predicted_hit_blocks: int = 0
    prefill: RouteDecision | None = None

    def __post_init__(self) -> None:
        assert self.ranked and self.ranked[0] == self.worker_id, "the chosen worker ranks first"


class RoutingPolicy(Protocol):
    """A routing policy. Deterministic given its constructor arguments (seed included) and the
    sequence of calls; reads no clock and performs no I/O."""

    @property
    def name(self) -> str:
        """The policy's name in `make_policy` and in metrics."""
        ...

    @property
    def replica_safe(self) -> bool:
        """Whether gateway replicas that each see only part of the traffic still send one
        prefix to one worker (no choice rests on what only this replica learned). The gateway
        warns when a policy that is not runs on workers other routers also use."""
        ...

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        """Choose a healthy worker; raises NoHealthyWorker when none is healthy. Does not assume
        the request is sent: call `observe` when it is."""
        ...

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """The request was sent to `worker_id`: update any index."""
        ...

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything about a worker that left the fleet."""
        ...


@runtime_checkable
class CapacityAware(Protocol):
    """A policy whose index of a worker should hold no more than the worker's KV cache can
    (`cache_aware`: it cannot see evictions, so it forgets at the worker's capacity instead).
    The gateway calls it when it learns a worker's capacity from the worker's /metrics; the
    fleet simulator when it builds the fleet."""

    def set_worker_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's KV cache holds `kv_tokens` tokens."""
        ...


def healthy_workers(workers: Iterable[WorkerView]) -> list[WorkerView]:
    """The healthy workers sorted by id, so a decision never depends on the order a caller lists
    the fleet in; raises NoHealthyWorker when there are none."""
    views = list(workers)
    healthy = sorted((w for w in views if w.healthy), key=lambda w: w.worker_id)
    if not healthy:
        raise NoHealthyWorker(len(views))
    return healthy
