"""What one scheduler step hands the engine: the step's work, and the queues' counts.

Values only (the scheduler builds them; `EngineCore`, the model executors and the simulator read
them): a `SchedulerOutput` lists each `ScheduledRequest`'s token range and block table, and
`SchedulerCounts` is a snapshot safe to hand to another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.kvcache import KVTransfers


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens `[start, start + num_new_tokens)`.

    `block_table` lists the physical blocks holding the request's whole context. `sample` is
    True when this chunk reaches the end of the request's tokens, so its last logits are used.
    `joined`: the requests of the same step that write some of its context's blocks (it shares
    their prompt blocks in flight); it may run only in a step that runs them too.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_table: tuple[int, ...]
    joined: tuple[str, ...] = ()

    @property
    def sample(self) -> bool:
        return self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


@dataclass(frozen=True, slots=True)
class SchedulerCounts:
    """The scheduler's queues and running totals at one moment: a value, safe to hand to
    another thread (metrics, /debug, the simulator's scrapes)."""

    num_running: int
    num_waiting: int
    num_waiting_deferred: int  # of the waiting, those the last step left to hit blocks in flight
    num_preemptions: int
    num_swap_preemptions: int
    num_scheduled_tokens: int  # tokens whose KV the steps computed (recomputes too)
    running_loras: tuple[str, ...] = ()  # distinct LoRA adapter names running (sorted)
    waiting_loras: tuple[str, ...] = ()  # ... and waiting (vLLM's lora_requests_info)
    num_waiting_for_adapter: int = 0  # waiting requests the last step left for --max-loras


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes, plus the requests that ended while scheduling it.

    `kv_transfers`: the copies between the device pool and the host tier the model must run
    before the forward pass (offloads, then loads), even when nothing is scheduled.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # timeouts, corruption, too long
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
