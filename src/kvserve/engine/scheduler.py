"""The scheduler: which requests run this step, and how many tokens each computes.

There are no prefill and decode phases: each request's `num_computed_tokens` catches up with its
`num_tokens` under one token budget per step. Running requests go first (oldest first), then
waiting ones in arrival order. When blocks run out, the most recently admitted running request is
preempted: by recompute (its blocks freed, its KV recomputed later; its cached prefix blocks stay
hit-able) or, in swap mode, by swapping (its KV copied to host slots private to it and back when
it resumes, nothing recomputed; recompute when the host tier has no room).
A waiting request whose prompt blocks another request is computing waits and hits them, unless
that request writes them in the very step being planned: then it shares them at once, in the
same forward pass, and leaves the step with it if it fails (see `KVCacheManager.lookup`).
At most `max_loras` distinct LoRA adapters run in one step: running requests keep theirs; a
waiting request of another adapter waits while the step is full of adapters, and later requests
(of the base model or of the step's adapters) may go first meanwhile.
With a host tier, each step also carries the copies between the tiers its allocations need
(`SchedulerOutput.kv_transfers`), confirmed in `commit_step` or undone in `abandon_step`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvserve.engine.config import SchedulerConfig
from kvserve.engine.integrity import IntegrityChecks
from kvserve.engine.preemption import Preemption
from kvserve.engine.request import FinishReason, Request, RequestStatus
from kvserve.engine.scheduler_output import ScheduledRequest, SchedulerCounts, SchedulerOutput
from kvserve.kvcache import AuditReport, CacheCorruption, FreeReason, KVCacheManager, PrefixHit

# The step's values live in scheduler_output.py; importable from here too.
__all__ = ["ScheduledRequest", "Scheduler", "SchedulerCounts", "SchedulerOutput"]

_FREE_REASONS = {
    FinishReason.STOP: FreeReason.FINISHED,
    FinishReason.LENGTH: FreeReason.FINISHED,
    FinishReason.ABORT: FreeReason.ABORTED,
    FinishReason.TIMEOUT: FreeReason.TIMEOUT,
    FinishReason.ERROR: FreeReason.ERROR,
}


class Scheduler:
    """Continuous batching over a `KVCacheManager`. Single-threaded: the step loop owns it."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.preemption = Preemption(config.preemption_mode, kv_cache)  # engine/preemption.py
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_scheduled_tokens = 0  # tokens whose KV the steps computed (recomputes too)
        self._now = 0.0  # the current step's time, for the requests it admits
        self.num_deferred = 0  # waiting requests the last step left to hit blocks in flight
        self.num_waiting_for_adapter = 0  # waiting requests the last step left for --max-loras
        self._integrity = IntegrityChecks(config, kv_cache)

    # -- admission ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. A prompt that can never run is refused here, never left to hang."""
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError (saying how to fix it) for a request `add_request` would refuse."""
        limit = self.max_seq_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens is too long: the limit is "
                f"{limit - 1} (max_model_len {self.config.max_model_len}, KV cache "
                f"{self.kv_cache.pool.num_blocks * self.kv_cache.block_size} tokens); shorten it"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence that can run: the model's limit, or the whole cache if smaller
        (a lone request that fits the cache always makes progress)."""
        return min(self.config.max_model_len,
                   self.kv_cache.pool.num_blocks * self.kv_cache.block_size)

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    @property
    def num_swap_preemptions(self) -> int:
        """Of the preemptions, those by swapping (the rest recompute)."""
        return self.preemption.num_swap_preemptions

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def live_request_ids(self) -> set[str]:
        return set(self.requests)

    def counts(self) -> SchedulerCounts:
        return SchedulerCounts(len(self.running), len(self.waiting), self.num_deferred,
                               self.num_preemptions, self.num_swap_preemptions,
                               self.num_scheduled_tokens, _adapter_names(self.running),
                               _adapter_names(self.waiting), self.num_waiting_for_adapter)

    # -- one step -------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick this step's work. Every scheduled request's blocks are verified first."""
        # Invariant: the step's tokens never exceed the budget, and every request either runs
        # with all the slots it needs or does not run at all.
        out = SchedulerOutput()
        self._now = now
        self._expire(now, out)
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        # Tokens whose KV this step will have written, per request planned into it so far: a
        # request admitted later in the step may share their prompt blocks in flight.
        in_flight: dict[str, int] = {}

        # The step's adapters (by digest): the running requests' adapters are all loaded.
        adapters = {r.lora.digest for r in self.running if r.lora is not None}
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.preemption.allocate_or_preempt(request, num_new, self.running,
                                                       self.waiting, out.preempted):
                break  # the request itself was preempted: everything after it already was
            scheduled.append(self._scheduled(request, num_new))
            in_flight[request.request_id] = request.num_computed_tokens + num_new
            budget -= num_new
            idx += 1

        skipped: list[Request] = []
        num_adapter_waits = 0
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if (request.lora is not None and request.lora.digest not in adapters
                    and len(adapters) >= self.config.max_loras):
                skipped.append(self.waiting.popleft())  # no adapter slot this step
                num_adapter_waits += 1
                continue
            kv = self.kv_cache
            if kv.is_swapped(request.request_id):
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if kv.swap_in(request.request_id, num_new) is None:
                    break  # first come, first served, swapped-out requests included
                self._admit(request, num_new, scheduled)
                if request.lora is not None:
                    adapters.add(request.lora.digest)
                in_flight[request.request_id] = request.num_computed_tokens + num_new
                budget -= num_new
                continue
            if not kv.has_request(request.request_id):
                kv.add_request(request.request_id, request.all_token_ids,
                               cache_salt=request.cache_salt,
                               adapter_digest=request.lora.digest if request.lora else None)
            # A request that wants prompt logprobs computes its whole prompt: cached tokens
            # have no logits.
            hit = (PrefixHit() if request.sampling_params.prompt_logprobs is not None
                   else kv.lookup(request.request_id, in_flight))
            if hit.num_pending_tokens:
                # Another running request is computing this prompt's next blocks in a later
                # step (an n > 1 sibling, a burst sharing a system prompt, chunked): wait and
                # hit them, rather than computing them twice. Later requests may go first
                # meanwhile. Blocks written in this very step are shared now (`in_flight`).
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if kv.allocate_slots(request.request_id, num_new, hit) is None:
                break  # first come, first served: nobody overtakes the head of the queue
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            self._admit(request, num_new, scheduled, hit.in_flight_owners)
            if request.lora is not None:
                adapters.add(request.lora.digest)
            in_flight[request.request_id] = hit.num_tokens + num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        self.num_deferred = len(skipped) - num_adapter_waits
        self.num_waiting_for_adapter = num_adapter_waits

        out.scheduled = self._verified(scheduled, out)
        self.num_scheduled_tokens += out.num_batched_tokens
        # Taken last: a request that failed verification took its loads with it.
        out.kv_transfers = self.kv_cache.take_transfers()
        self.num_steps += 1
        return out

    def _admit(self, request: Request, num_new: int, scheduled: list[ScheduledRequest],
               joined: tuple[str, ...] = ()) -> None:
        """The head of the queue got its slots: it runs from this step on."""
        self.waiting.popleft()
        if request.scheduled_time is None:
            request.scheduled_time = self._now
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(self._scheduled(request, num_new, joined))

    def _scheduled(self, request: Request, num_new: int,
                   joined: tuple[str, ...] = ()) -> ScheduledRequest:
        table = tuple(self.kv_cache.block_table(request.request_id))
        return ScheduledRequest(request, request.num_computed_tokens, num_new, table, joined)

    def _verified(
        self, scheduled: list[ScheduledRequest], out: SchedulerOutput
    ) -> list[ScheduledRequest]:
        kept = []
        for item in scheduled:
            try:
                self.kv_cache.verify(item.request.request_id)
            except CacheCorruption as exc:
                self.finish(item.request, FinishReason.ERROR, error=str(exc))
                out.finished.append(item.request)
                continue
            kept.append(item)
        # A request that shares blocks in flight leaves with their writer (repeated: a joiner
        # may itself be the writer of another's blocks).
        while True:
            running = {item.request.request_id for item in kept}
            orphans = [item.request for item in kept if not running.issuperset(item.joined)]
            if not orphans:
                return kept
            self.preemption.recompute_later(orphans, self.running, self.waiting)
            kept = [item for item in kept if item.request.status is RequestStatus.RUNNING]

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        expired = [r for r in (*self.running, *self.waiting)
                   if (r.deadline is not None and now >= r.deadline)
                   or (r.first_token_deadline is not None and not r.output_token_ids
                       and now >= r.first_token_deadline)]
        for request in expired:
            self.finish(request, FinishReason.TIMEOUT)
            out.finished.append(request)

    # -- after the model ran --------------------------------------------------------------

    def commit_step(self, output: SchedulerOutput) -> list[Request]:
        """Record that the step's KV was written (its copies between the tiers first, so loaded
        blocks are published before the blocks computed after them). Returns the requests that
        now need their sampled token appended (computed tokens reached the end of the sequence)."""
        self.kv_cache.complete_transfers(output.kv_transfers)
        ready = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran; its blocks are already free
            request.num_computed_tokens = item.start + item.num_new_tokens
            self.kv_cache.commit(request.request_id, request.num_computed_tokens)
            if item.sample:
                ready.append(request)
        return ready

    def abandon_step(self, output: SchedulerOutput, error: str) -> list[Request]:
        """The model failed to run `output`: its copies between the tiers are undone (nothing
        half-copied becomes readable) and the requests whose loaded KV is missing are ended
        with an error. Returns them; other requests recompute the step's tokens later (a
        request it was swapping out recomputes all of them)."""
        failed = self.kv_cache.cancel_transfers(output.kv_transfers)
        ended = [item.request for item in output.scheduled
                 if item.request.request_id in failed and not item.request.is_finished]
        for request in ended:
            self.finish(request, FinishReason.ERROR, error=error)
        # What they shared in flight was never written: they recompute from the start.
        self.preemption.recompute_later([item.request for item in output.scheduled
                                         if item.joined and not item.request.is_finished],
                                        self.running, self.waiting)
        for request in self.waiting:  # a swap-out the step carried is lost: recompute
            if request.num_computed_tokens and not self.kv_cache.has_request(request.request_id):
                request.num_computed_tokens = 0
        return ended

    def append_token(self, request: Request, token_id: int) -> None:
        """Append a sampled token to a running request (its KV is computed next step)."""
        self.kv_cache.append_token_ids(request.request_id, [token_id])

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request for any reason: the one path that frees its blocks. Idempotent."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.requests.pop(request.request_id, None)
        self.kv_cache.free(request.request_id, _FREE_REASONS[reason])

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests by id (unknown or finished ones are ignored); returns those ended."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.finish(request, FinishReason.ABORT)
                ended.append(request)
        return ended

    # -- integrity ------------------------------------------------------------------------

    def check_integrity(self, now: float) -> AuditReport | None:
        """The cache check due after this step (engine/integrity.py); None when nothing was
        due. Blocks held by requests the scheduler no longer knows are reclaimed (and counted)
        after a failed check."""
        return self._integrity.after_step(now, not self.has_unfinished, self.num_steps,
                                          self.requests.keys())


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct LoRA adapter names of `requests`, sorted."""
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
