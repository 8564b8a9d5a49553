"""EngineCore: one step = schedule → execute the model → apply the sampled tokens.

Pure Python: the model is behind the `ModelExecutor` protocol (the runtime plugs the torch runner
in; tests plug in a deterministic toy model; the fleet simulator a virtual-clock executor, and
it calls the step's three parts itself, so that simulated time passes while the model runs).
Not thread-safe: the runtime's step loop owns it and applies cross-thread aborts between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.config import SchedulerConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from kvserve.engine.request import FinishReason, Request, TokenLogprob
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import SchedulerCounts, SchedulerOutput
from kvserve.kvcache import AuditReport


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The model's choice for one request this step."""

    token_id: int
    logprob: TokenLogprob | None = None


class ModelExecutor(Protocol):
    """Runs one scheduled step: its `kv_transfers` (offloads, then loads), then the forward pass
    over `scheduled` (possibly empty); returns a sampled token for every item with `sample`."""

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]: ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state (sampling generators) of requests that ended."""

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """The last step's prompt logprobs, per request asking for them: (prompt position,
        logprob of the prompt token there and the top alternatives). Asked only after a step
        that ran a prefill chunk of such a request."""


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one request produced in one step; the last delta of a request has `finished`."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[TokenLogprob, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    scheduled_time: float | None = None  # when the request first ran (engine clock)
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Set once, on the delta of the request's first output token (its prompt is done).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(slots=True)
class PlannedStep:
    """A step scheduled and not yet applied: the scheduler's output, and the final deltas of
    the requests that ended before it (aborts between steps, timeouts, corruption)."""

    output: SchedulerOutput
    ended: list[RequestDelta]


class EngineCore:
    """Owns the scheduler and each request's detokenizer; turns model output into deltas."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        decoder: TokenDecoder | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_audit: Callable[[AuditReport], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.decoder = decoder
        self.clock = clock
        self.on_audit = on_audit
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: dict[str, RequestDelta] = {}  # deltas of requests ended between steps

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (nothing queued) if it can never run."""
        self.scheduler.add_request(request)
        params = request.sampling_params
        if params.prompt_logprobs is not None and not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # the first token has nothing before it
        if self.decoder is not None and params.detokenize:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.decoder, request.prompt_token_ids, params.stop,
                params.include_stop_str_in_output, params.skip_special_tokens,
            )

    def check_request(self, request: Request) -> None:
        """Raise ValueError for a request `add_request` would refuse (changes nothing)."""
        self.scheduler.check_request(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests now; their final deltas come out of the next `step`."""
        for request in self.scheduler.abort(request_ids):
            self._pending[request.request_id] = self._final_delta(request, (), (), "")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending)

    def step(self) -> list[RequestDelta]:
        """Run one step; returns the deltas of every request that produced or ended."""
        planned = self.plan_step()
        return self.apply_step(planned, self.execute(planned))

    def plan_step(self) -> PlannedStep:
        """The first third of `step`: schedule (its slots allocated) and collect the requests
        that ended since the last step. Every planned step must be executed and applied, in
        order, before the next one is planned."""
        deltas = list(self._pending.values())
        self._pending.clear()
        out = self.scheduler.schedule(self.clock())
        for request in out.finished:
            deltas.append(self._final_delta(request, (), (), ""))
        return PlannedStep(out, deltas)

    def execute(self, planned: PlannedStep) -> dict[str, SampledToken]:
        """The second third: run the model on the planned step (nothing when it is empty). A
        model failure ends the requests it left without KV, and is raised."""
        out = planned.output
        if out.is_empty and not out.kv_transfers:
            return {}
        try:
            return self.executor.execute(out)
        except BaseException as exc:
            for request in self.scheduler.abandon_step(out, f"the model step failed: {exc!r}"):
                self._pending[request.request_id] = self._final_delta(request, (), (), "")
            raise

    def apply_step(self, planned: PlannedStep,
                   sampled: dict[str, SampledToken]) -> list[RequestDelta]:
        """The last third: commit the step's KV, append the sampled tokens, stop what is done,
        run the due integrity check. A simulator lets virtual time pass before calling it."""
        out, deltas = planned.output, planned.ended
        if not out.is_empty or out.kv_transfers:
            if any(item.request.sampling_params.prompt_logprobs is not None
                   and item.start < item.request.num_prompt_tokens for item in out.scheduled):
                self._store_prompt_logprobs(self.executor.take_prompt_logprobs())
            now = self.clock()
            for request in self.scheduler.commit_step(out):
                deltas.append(self._apply(request, sampled[request.request_id], now))
        self._release_finished(deltas)
        self._check_integrity()
        return deltas

    def fail_all(self, error: str) -> None:
        """End every live request with `error`, freeing its blocks, without running a step
        (the model can no longer run)."""
        scheduler = self.scheduler
        for request in [*scheduler.running, *scheduler.waiting]:
            scheduler.finish(request, FinishReason.ERROR, error=error)

    # -- views ----------------------------------------------------------------------------

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def max_seq_len(self) -> int:
        return self.scheduler.max_seq_len

    @property
    def running_request_ids(self) -> list[str]:
        """Running requests, oldest admitted first."""
        return [request.request_id for request in self.scheduler.running]

    @property
    def live_request_ids(self) -> set[str]:
        """Every request the engine holds (waiting or running): the audit's view of who may
        hold blocks."""
        return self.scheduler.live_request_ids

    def counts(self) -> SchedulerCounts:
        return self.scheduler.counts()

    def _store_prompt_logprobs(self, found: dict[str, list[tuple[int, TokenLogprob]]]) -> None:
        for request_id, entries in found.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            for position, logprob in entries:
                if position == len(request.prompt_logprobs):  # else a recompute: kept already
                    request.prompt_logprobs.append(logprob)

    def _apply(self, request: Request, token: SampledToken, now: float) -> RequestDelta:
        if request.first_token_time is None:
            request.first_token_time = now
        request.append_output_token(token.token_id, token.logprob)
        self.scheduler.append_token(request, token.token_id)
        detok = self._detokenizers.get(request.request_id)
        text = detok.add_token(token.token_id) if detok is not None else ""
        reason = self._stop_reason(request, detok)
        new_logprobs = (token.logprob,) if token.logprob is not None else ()
        prompt_logprobs = None
        if len(request.output_token_ids) == 1 and request.sampling_params.prompt_logprobs \
                is not None:
            prompt_logprobs = tuple(request.prompt_logprobs)
        if reason is None:
            return RequestDelta(request.request_id, (token.token_id,), text, new_logprobs, False,
                                None, request.num_prompt_tokens, request.num_cached_tokens,
                                scheduled_time=request.scheduled_time,
                                num_preemptions=request.num_preemptions,
                                prompt_logprobs=prompt_logprobs)
        self.scheduler.finish(request, reason)
        return self._final_delta(request, (token.token_id,), new_logprobs, text,
                                 prompt_logprobs)

    def _stop_reason(
        self, request: Request, detok: IncrementalDetokenizer | None
    ) -> FinishReason | None:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        last = request.output_token_ids[-1]
        if detok is not None and detok.stopped:
            request.stop_reason = detok.matched_stop
            return FinishReason.STOP
        if num_out >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                request.stop_reason = last
                return FinishReason.STOP
        if request.num_output_tokens_left(self.scheduler.max_seq_len) <= 0:
            return FinishReason.LENGTH
        return None

    def _final_delta(
        self,
        request: Request,
        token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprob, ...],
        text: str,
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None,
    ) -> RequestDelta:
        detok = self._detokenizers.pop(request.request_id, None)
        if detok is not None:
            text += detok.flush()
        return RequestDelta(request.request_id, token_ids, text, logprobs, True,
                            request.finish_reason, request.num_prompt_tokens,
                            max(request.num_cached_tokens, 0), request.error,
                            request.scheduled_time, request.num_preemptions,
                            request.stop_reason, prompt_logprobs)

    def _release_finished(self, deltas: list[RequestDelta]) -> None:
        finished = [d.request_id for d in deltas if d.finished]
        if finished:
            self.executor.release(finished)

    def _check_integrity(self) -> None:
        report = self.scheduler.check_integrity(self.clock())
        if report is not None and self.on_audit is not None:
            self.on_audit(report)
