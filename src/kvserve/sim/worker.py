"""A simulated worker: kvserve.engine's own `EngineCore` and `Scheduler` over a real
KVCacheManager, with a virtual-clock model (`executor.SimExecutor`), stepping on the simulated
clock. Aborts take effect between steps, as in the engine's step loop.

Time: a step is planned when it starts (`EngineCore.plan_step`, then `execute`, which prices
it with the cost model) and applied when it ends (`apply_step`), so the fleet sees its effects,
and scrapes see its state, at the simulated instant the real step would finish. A run of
identical decode steps (the batch unchanged, nobody finishing before its last step, blocks to
spare) is one event whose duration has a closed form; the run's later steps are then planned
and applied back to back by the same engine when it ends. An arrival or abort cuts it at the
step in progress. The cache sees the same calls as step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine import (
    EngineCore,
    FinishReason,
    PlannedStep,
    PreemptionMode,
    Request,
    RequestDelta,
    SampledToken,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from kvserve.gateway.core.adapters import AdapterState
from kvserve.kvcache import KVCacheManager
from kvserve.sim.adapters import AdapterSlots
from kvserve.sim.costmodel import CostProfile
from kvserve.sim.events import EventQueue, Priority
from kvserve.sim.executor import SimExecutor
from kvserve.sim.seq import SimSeq, WorkerListener


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker's size: KV blocks and block size, and the scheduler's limits (vLLM's names).
    `fast_forward=False` steps decode runs one event each (to check the fast path against)."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    fast_forward: bool = True
    enable_lora: bool = False  # serves LoRA adapters (and says so in its metrics)
    max_loras: int = 1  # distinct LoRA adapters a step runs, and device slots (vLLM's name)
    adapter_load_s: float = 0.0  # loading an adapter into a slot (`adapters.AdapterSlots`)

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_batched_tokens,
               self.max_num_seqs, self.max_model_len or 1, self.max_loras) < 1:
            raise ValueError("worker sizes and limits must all be >= 1")

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's config: recompute preemption, no periodic audit; the full audit on
        the first drain only (the simulator audits every cache once more at the end)."""
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs,
                               self.max_model_len or self.num_blocks * self.block_size,
                               idle_audit_interval_s=float("inf"),
                               preemption_mode=PreemptionMode.RECOMPUTE,
                               max_loras=self.max_loras)


@dataclass(slots=True)
class _Step:
    """The step in flight, planned and executed; `num_steps` > 1 is a decode run."""

    planned: PlannedStep
    sampled: dict[str, SampledToken]
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
        self.slots = AdapterSlots(config.max_loras)
        self.executor = SimExecutor(cost, self.slots, config.adapter_load_s)
        self._now = 0.0  # the engine's clock: the start, then the end, of the step it is at
        self.core = EngineCore(Scheduler(config.scheduler_config(), self.kv), self.executor,
                               clock=lambda: self._now)
        self.counters = WorkerCounters()
        self._seqs: dict[str, SimSeq] = {}  # live seqs by id (= engine request id)
        self._step: _Step | None = None
        self._version = 0
        self._pending_aborts: list[SimSeq] = []
        self._arrivals: list[Request] = []  # submitted during the step in flight

    # -- requests from the gateway --------------------------------------------------------

    def submit(self, seq: SimSeq, now: float) -> bool:
        """Queue `seq`; False (nothing queued) if the engine refuses it (its 400: a prompt of
        at least `max_seq_len` tokens). During a step it reaches the engine when the step
        ends, as the engine's step loop adds requests between steps."""
        prompt = seq.prompt if isinstance(seq.prompt, list) else list(seq.prompt)
        request = Request(seq.seq_id, prompt, SamplingParams(max_tokens=seq.max_tokens,
                                                             detokenize=False),
                          arrival_time=now, cache_salt=seq.tenant, lora=seq.adapter)
        try:
            self.core.check_request(request)
        except ValueError:
            return False
        self._seqs[seq.seq_id] = seq
        if self._step is None:
            self.core.add_request(request)
            self._start_step(now)
        else:
            self._arrivals.append(request)
            self._cut_run(now)
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
        return self.core.counts().num_running

    @property
    def num_waiting(self) -> int:
        """Waiting in the engine, and submitted during the step in flight (the engine's
        server counts those as waiting too)."""
        return self.core.counts().num_waiting + len(self._arrivals)

    @property
    def adapters(self) -> AdapterState | None:
        """Its LoRA adapters as `vllm:lora_requests_info` says them (None without
        `enable_lora`, as a worker serving no adapters exports none)."""
        if not self.config.enable_lora:
            return None
        counts = self.core.counts()
        waiting = {*counts.waiting_loras, *(r.lora.name for r in self._arrivals if r.lora)}
        return AdapterState(self.config.max_loras, frozenset(counts.running_loras),
                            frozenset(waiting))

    @property
    def num_adapter_loads(self) -> int:
        return self.slots.num_loads

    @property
    def num_preemptions(self) -> int:
        return self.core.counts().num_preemptions

    @property
    def kv_usage(self) -> float:
        pool = self.kv.pool
        return (pool.num_blocks - pool.num_free_blocks) / pool.num_blocks

    @property
    def is_idle(self) -> bool:
        return self._step is None and not self._seqs

    # -- stepping -------------------------------------------------------------------------

    def _start_step(self, now: float) -> None:
        self._now = now
        running = self.core.running_request_ids
        planned = self.core.plan_step()
        assert all(d.finish_reason is FinishReason.ABORT for d in planned.ended), \
            "a simulated request ends only by its length or an abort"
        if planned.output.is_empty:
            self.core.apply_step(planned, {})  # the drain's idle check
            return
        sampled = self.core.execute(planned)
        step = _Step(planned, sampled, now, now + self.executor.last_step_s)
        if (self.config.fast_forward and self.executor.last_num_loads == 0
                and self._is_plain_decode(planned, running)):
            num_steps = self._decode_run_length(planned)
            if num_steps > 1:
                step.num_steps = num_steps
                step.decode_context = self.executor.last_shape.decode_context
                step.ends_at = now + self._run_s(step, num_steps)
        self._step = step
        self._push_step_end()

    def _is_plain_decode(self, planned: PlannedStep, running: list[str]) -> bool:
        """One decode token for each of the running requests (or the budget's head of them):
        nothing admitted, preempted or ended. Repeating it changes nothing but lengths."""
        out = planned.output
        if out.preempted or out.finished or not out.scheduled:
            return False
        if [item.request.request_id for item in out.scheduled] != running[:len(out.scheduled)]:
            return False
        return all(item.num_new_tokens == 1 and item.start >= item.request.num_prompt_tokens
                   for item in out.scheduled)

    def _decode_run_length(self, planned: PlannedStep) -> int:
        """How many such steps can run with nothing changing: until the first request reaches
        its length limit (the engine's rule, `Request.num_output_tokens_left`), and no further
        than the free blocks allow (the cache's rule, `num_blocks_to_grow`)."""
        items = planned.output.scheduled
        max_seq_len = self.core.max_seq_len
        steps = min(item.request.num_output_tokens_left(max_seq_len) for item in items)
        ids = [item.request.request_id for item in items]
        free = self.kv.pool.num_free_blocks

        def fits(num_steps: int) -> bool:  # step k holds one more token than step k - 1
            return self.kv.num_blocks_to_grow(ids, num_steps - 1) <= free

        if fits(steps):
            return max(steps, 1)
        lo, hi = 1, steps  # the largest m with fits(m); fits(1) holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

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
        num_seqs = len(step.planned.output.scheduled)
        return self.cost.decode_run_s(num_seqs, step.decode_context, num_steps)

    def _on_step_end(self, now: float, version: int) -> None:
        step = self._step
        if step is None or version != self._version:
            return  # superseded: the run was cut short
        counters = self.counters
        counters.busy_s += step.ends_at - step.started_at
        counters.num_steps += step.num_steps
        self._now = now if step.num_steps == 1 else step.started_at + self._run_s(step, 1)
        deltas = self._apply(step.planned, step.sampled)
        for k in range(2, step.num_steps + 1):  # the run's later steps, back to back
            self._now = step.started_at + self._run_s(step, k - 1)
            running = self.core.running_request_ids
            planned = self.core.plan_step()
            assert self._is_plain_decode(planned, running), "a decode run changed its batch"
            sampled = self.core.execute(planned)
            self._now = step.started_at + self._run_s(step, k)
            deltas += self._apply(planned, sampled)
        self._step = None
        news = self._take(deltas, now)
        arrivals, self._arrivals = self._arrivals, []
        for request in arrivals:
            self.core.add_request(request)
        aborts, self._pending_aborts = self._pending_aborts, []
        for seq in aborts:
            self._abort_now(seq)
        # The fleet hears of the step only now, with the engine between steps: what it sends
        # back (an admitted request for this worker) starts the next step at once.
        for seq, is_first_token, is_finished in news:
            if is_first_token:
                self.listener.on_first_token(seq, now)
            if is_finished:
                self.listener.on_finish(seq, now)
        if self._step is None:
            self._start_step(now)

    def _apply(self, planned: PlannedStep, sampled: dict[str, SampledToken]) -> list[RequestDelta]:
        for item in planned.output.scheduled:
            num_new = item.num_new_tokens
            self._seqs[item.request.request_id].num_work_tokens += num_new
            self.counters.computed_tokens += num_new
        return self.core.apply_step(planned, sampled)

    def _take(self, deltas: list[RequestDelta], now: float) -> list[tuple[SimSeq, bool, bool]]:
        """Record the deltas on their seqs; returns, in step order, each seq that got its
        first token or finished (its blocks already free), and which."""
        news = []
        for delta in deltas:
            seq = self._seqs.get(delta.request_id)
            if seq is None:
                continue  # aborted: counted when it was
            seq.num_cached = delta.num_cached_tokens
            is_first_token = bool(delta.new_token_ids) and seq.first_token_at is None
            if is_first_token:
                seq.first_token_at = now
            if delta.finished:
                assert delta.finish_reason is FinishReason.LENGTH, delta
                del self._seqs[delta.request_id]
                seq.is_finished, seq.finished_at = True, now
                self.counters.num_finished += 1
            if is_first_token or delta.finished:
                news.append((seq, is_first_token, delta.finished))
        return news

    def _abort_now(self, seq: SimSeq) -> None:
        if seq.is_finished:
            return
        self.core.abort([seq.seq_id])
        del self._seqs[seq.seq_id]
        seq.is_finished = True
        self.counters.num_aborted += 1
        self.counters.wasted_tokens += seq.num_work_tokens
