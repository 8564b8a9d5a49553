"""A simulated worker: a real KVCacheManager under the engine's scheduling rules
(`scheduler.SimScheduler`), stepping on the simulated clock. Aborts and arrivals take effect
between steps, as in the engine's step loop.

Time: a step's duration comes from the cost model. A run of identical decode-only steps (no
admission possible, nobody finishing, blocks to spare) is fast-forwarded as one event and its
cache calls are made in bulk; an arrival or abort cuts it at the step in progress. The cache sees
the same allocations, commits and evictions as step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache import FreeReason, KVCacheManager
from kvserve.sim.costmodel import CostProfile
from kvserve.sim.events import EventQueue, Priority
from kvserve.sim.scheduler import Item, SchedulerLimits, SimScheduler, step_shape
from kvserve.sim.seq import OUTPUT_TOKEN_ID, SimSeq, WorkerListener


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker's size: KV blocks and block size, and the scheduler's limits (vLLM's names).
    `fast_forward=False` steps decode runs one by one (to check the fast path against)."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_batched_tokens,
               self.max_num_seqs, self.max_model_len or 1) < 1:
            raise ValueError("worker sizes and limits must all be >= 1")

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(slots=True)
class _Step:
    """The step in flight: (seq, start, num_new) items; `num_steps` > 1 is a decode run."""

    items: list[Item]
    started_at: float
    ends_at: float
    num_steps: int = 1
    decode_context: int = 0


@dataclass(slots=True)
class WorkerCounters:
    """Work done, for utilisation and load figures."""

    busy_s: float = 0.0
    num_steps: int = 0
    computed_tokens: int = 0
    wasted_tokens: int = 0  # computed for seqs that were then aborted
    num_aborted: int = 0
    num_finished: int = 0


class SimWorker:
    """One engine on the simulated clock. Single-threaded like the engine's step loop."""

    def __init__(self, worker_id: str, config: WorkerConfig, cost: CostProfile,
                 events: EventQueue, listener: WorkerListener) -> None:
        self.worker_id = worker_id
        self.config = config
        self.cost = cost
        self.events = events
        self.listener = listener
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
                                 clock=lambda: events.now)
        limit = config.num_blocks * config.block_size
        self.max_seq_len = min(config.max_model_len or limit, limit)
        self.scheduler = SimScheduler(config.limits, self.kv, self.max_seq_len)
        self.counters = WorkerCounters()
        self._step: _Step | None = None
        self._version = 0
        self._pending_aborts: list[SimSeq] = []

    # -- requests from the gateway --------------------------------------------------------

    def submit(self, seq: SimSeq, now: float) -> bool:
        """Queue `seq`; False (nothing queued) if its prompt can never run here (the engine's
        400: prompt of at least `max_seq_len` tokens)."""
        if seq.num_prompt_tokens >= self.max_seq_len:
            return False
        self.scheduler.waiting.append(seq)
        self._wake(now)
        return True

    def abort(self, seq: SimSeq, now: float) -> None:
        """End `seq` (the client went away). Between steps it is freed at once; during a step it
        is freed when the step ends. Idempotent."""
        if seq.is_finished:
            return
        if self._step is not None:
            self._pending_aborts.append(seq)
            self._cut_run(now)
        else:
            self._abort_now(seq)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        pool = self.kv.pool
        return (pool.num_blocks - pool.num_free_blocks) / pool.num_blocks

    @property
    def is_idle(self) -> bool:
        return self._step is None and not self.num_waiting and not self.num_running

    # -- stepping -------------------------------------------------------------------------

    def _wake(self, now: float) -> None:
        if self._step is None:
            self._start_step(now)
        else:
            self._cut_run(now)

    def _start_step(self, now: float) -> None:
        items, is_plain_decode = self.scheduler.schedule()
        if not items:
            return
        shape = step_shape(items)
        step = _Step(items, now, now + self.cost.step_s(shape), 1, shape.decode_context)
        if is_plain_decode and self.config.fast_forward:
            num_steps = self.scheduler.decode_run_length(items)
            if num_steps > 1:
                step.num_steps = num_steps
                step.ends_at = now + self.cost.decode_run_s(len(items), step.decode_context,
                                                            num_steps)
        self._step = step
        self._push_step_end()

    def _push_step_end(self) -> None:
        assert self._step is not None
        self._version += 1
        version = self._version
        self.events.push(self._step.ends_at, Priority.STEP_END,
                         lambda now: self._on_step_end(now, version))

    def _cut_run(self, now: float) -> None:
        """An arrival or abort: a decode run stops after the step in progress at `now`."""
        step = self._step
        if step is None or step.num_steps == 1:
            return
        lo, hi = 1, step.num_steps  # smallest m with started_at + run(m) >= now
        while lo < hi:
            mid = (lo + hi) // 2
            if step.started_at + self._run_s(step, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo < step.num_steps:
            step.num_steps = lo
            step.ends_at = step.started_at + self._run_s(step, lo)
            self._push_step_end()

    def _run_s(self, step: _Step, num_steps: int) -> float:
        return self.cost.decode_run_s(len(step.items), step.decode_context, num_steps)

    def _on_step_end(self, now: float, version: int) -> None:
        step = self._step
        if step is None or version != self._version:
            return  # superseded: the run was cut short
        self._step = None
        counters = self.counters
        counters.busy_s += step.ends_at - step.started_at
        counters.num_steps += step.num_steps
        kv = self.kv
        sampled: list[SimSeq] = []
        for seq, start, num_new in step.items:
            if seq.is_finished:
                continue
            if step.num_steps > 1:  # the run's later steps, in bulk (blocks were counted)
                extra = step.num_steps - 1
                kv.append_token_ids(seq.seq_id, [OUTPUT_TOKEN_ID] * extra)
                seq.num_tokens += extra
                seq.num_output += extra
                allocated = kv.allocate_slots(seq.seq_id, step.num_steps)
                assert allocated is not None, "a decode run never outgrows the free blocks"
                num_new = step.num_steps
            seq.num_computed = start + num_new
            seq.num_work_tokens += num_new
            counters.computed_tokens += num_new
            kv.commit(seq.seq_id, seq.num_computed)
            if seq.num_computed == seq.num_tokens:
                sampled.append(seq)
        for seq in sampled:
            self._sample(seq, now)
        aborts, self._pending_aborts = self._pending_aborts, []
        for seq in aborts:
            self._abort_now(seq)
        self._start_step(now)

    def _sample(self, seq: SimSeq, now: float) -> None:
        seq.num_output += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.listener.on_first_token(seq, now)
        if seq.num_output >= seq.max_tokens or seq.num_tokens + 1 >= self.max_seq_len:
            self.scheduler.running.remove(seq)
            self._end(seq, FreeReason.FINISHED, now)
            self.counters.num_finished += 1
            self.listener.on_finish(seq, now)
        else:
            self.kv.append_token_ids(seq.seq_id, [OUTPUT_TOKEN_ID])
            seq.num_tokens += 1

    def _abort_now(self, seq: SimSeq) -> None:
        if seq.is_finished:
            return
        self.scheduler.remove(seq)
        self._end(seq, FreeReason.ABORTED, None)
        self.counters.num_aborted += 1
        self.counters.wasted_tokens += seq.num_work_tokens

    def _end(self, seq: SimSeq, reason: FreeReason, now: float | None) -> None:
        seq.is_finished = True
        seq.finished_at = now
        self.kv.free(seq.seq_id, reason)
