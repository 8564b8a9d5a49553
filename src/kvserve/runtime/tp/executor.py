"""Running one step on every tensor-parallel rank: rank 0's executor and the other ranks' loop.

Rank 0 owns the scheduler and the KV-cache manager. Each step it flattens the scheduler's output
to a `StepPlan` (plain data), broadcasts it, and all ranks check in one all_gather that they
hold the same step id and block-table checksum before any K/V is written; a divergent rank is a
`RankDivergenceError` and the step is not run. Then every rank runs the forward pass over its
heads (two all_reduces per layer) and rank 0 alone computes logits and samples. The same
all_gather carries each rank's compute time of the previous step, the source of the rank-skew
metric.

With LoRA, rank 0's slots decide each step's adapters (which slot each sequence reads, which
adapters are copied in over which) before anything is sent; the decision travels in the same
broadcast as the plan, and every other rank copies its shard of those adapters into the same
slots before its forward pass. Adapters are fetched (and a changed file refused) on rank 0 only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine import SampledToken, SchedulerOutput, TokenLogprob
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.lora import AdapterSlots, SlotAssignment
from kvserve.model.runner import ModelRunner
from kvserve.model.step_plan import StepPlan, layout_checksum
from kvserve.runtime.collective_stats import CollectiveErrorKind, CollectiveStats
from kvserve.runtime.tp.comm import CollectiveError, Communicator, RankDivergenceError
from kvserve.runtime.tp.faults import Fault


class RankSupervisor(Protocol):
    """Whoever started the other ranks: stops them when rank 0 closes."""

    def stop(self) -> None: ...

    def lost_rank(self) -> tuple[int, str] | None:
        """(rank, what happened) of a rank found gone, if any."""


@dataclass(frozen=True, slots=True)
class RankStep:
    """One step as rank 0 broadcasts it: the plan, and what rank 0's adapter slots did for it
    (None: the engine serves no adapters)."""

    plan: StepPlan
    adapters: SlotAssignment | None = None


def check_step(comm: Communicator, step_id: int, checksum: int, prev_compute_ns: int,
               stats: CollectiveStats | None = None) -> list[int]:
    """All-gather (step id, checksum, previous step's compute ns) and compare every rank with
    rank 0; raises RankDivergenceError on every rank if one differs. Returns the compute ns."""
    rows = comm.all_gather_ints([step_id, checksum, prev_compute_ns])
    ref_step, ref_checksum, _ = rows[0]
    for rank, (got_step, got_checksum, _) in enumerate(rows):
        if got_step != ref_step or got_checksum != ref_checksum:
            if stats is not None:
                stats.divergence()
            comm.failed = True
            raise RankDivergenceError(rank, ref_step, got_step, ref_checksum, got_checksum)
    return [row[2] for row in rows]


class TensorParallelExecutor:
    """The engine's `ModelExecutor` on rank 0 of a tensor-parallel group."""

    def __init__(self, runner: ModelRunner, comm: Communicator, stats: CollectiveStats,
                 supervisor: RankSupervisor) -> None:
        self.runner = runner
        self.comm = comm
        self.stats = stats
        self.supervisor = supervisor
        self._prev_compute_ns = 0
        self._closed = False
        self._prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = {}

    @property
    def model(self) -> LlamaForCausalLM:
        return self.runner.model

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        # Invariant: every rank runs the plan rank 0 built, or none does (check_step first).
        assert not output.kv_transfers, "tensor parallelism runs without host/disk KV tiers"
        self._prompt_logprobs = {}
        if not output.scheduled:
            return {}
        begin = time.perf_counter()
        comm = self.comm
        comm.reset_wait()
        plan = StepPlan.from_output(output, self.runner.block_size, comm.step_id + 1)
        lora = self.runner.lora
        # Before anything is sent: an adapter refused here leaves the group where it was.
        adapters = lora.begin_step(output.scheduled, plan.query_start) if lora else None
        try:
            comm.step_id = plan.step_id
            comm.broadcast_object(RankStep(plan, adapters))
            computes = check_step(comm, plan.step_id, plan.checksum, self._prev_compute_ns,
                                  self.stats)
            if comm.step_id > 1:
                self.stats.observe_compute([ns / 1e9 for ns in computes])
            hidden = self.runner.forward(plan)  # [num_tokens, hidden], whole on every rank
        finally:
            if lora is not None:
                lora.end_step()
        self._prompt_logprobs = self.runner.score_prompts(output, plan.query_start, hidden)
        requests = [item.request for item in output.scheduled if item.sample]
        sampled = self.runner.sample(hidden, plan, requests)
        self._prev_compute_ns = int((time.perf_counter() - begin - comm.wait_s) * 1e9)
        return sampled

    def release(self, request_ids: Iterable[str]) -> None:
        self.runner.release(request_ids)

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """The last step's prompt logprobs, scored on rank 0 (see `ModelExecutor`)."""
        found, self._prompt_logprobs = self._prompt_logprobs, {}
        return found

    def check_ranks(self) -> None:
        """Between steps: raise CollectiveError if a rank's process is gone (or, on another
        node, stopped beating)."""
        lost = self.supervisor.lost_rank()
        if lost is not None:
            rank, detail = lost
            self.comm.failed = True
            self.stats.error("heartbeat", CollectiveErrorKind.RANK_LOST)
            raise CollectiveError("heartbeat", CollectiveErrorKind.RANK_LOST, self.comm.step_id,
                                  rank, detail)

    def close(self) -> None:
        """Tell the other ranks to exit (if the group still works), then make sure they did.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.comm.failed:
            with contextlib.suppress(RuntimeError):
                self.comm.broadcast_object(None)
        self.supervisor.stop()


def serve_rank(comm: Communicator, runner: ModelRunner, fault: Fault | None = None,
               adapters: AdapterSlots | None = None) -> None:
    """A rank other than 0: run every plan rank 0 broadcasts until it sends None, its LoRA
    `adapters` (this rank's shard of them) following rank 0's slots. Raises
    TensorParallelError (divergence, a failed collective) when the group cannot go on."""
    prev_compute_ns = 0
    expected_step = 1
    while True:
        step = comm.broadcast_object(None)
        if step is None:
            return
        assert isinstance(step, RankStep)
        plan = step.plan
        begin = time.perf_counter()
        comm.reset_wait()
        comm.step_id = plan.step_id
        if fault is not None:
            plan = fault.before_check(comm.rank, plan)
        checksum = layout_checksum(plan.block_tables, plan.slot_mapping)
        step_id = plan.step_id if plan.step_id == expected_step else expected_step
        check_step(comm, step_id, checksum, prev_compute_ns)
        if fault is not None:
            fault.before_forward(comm.rank, plan)
        if step.adapters is not None:
            assert adapters is not None, "rank 0 serves adapters and this rank has no slots"
            adapters.follow(step.adapters, plan.query_start)
        try:
            runner.forward(plan)
        finally:
            if adapters is not None:
                adapters.end_step()
        expected_step += 1
        prev_compute_ns = int((time.perf_counter() - begin - comm.wait_s) * 1e9)
