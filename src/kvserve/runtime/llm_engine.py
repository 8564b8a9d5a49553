"""LLMEngine: a loaded model, its paged KV cache, the scheduler and the runner, stepped together.

`add_request` (text or token ids; n samples become n engine requests sharing the prompt's
blocks) → `step()` (schedule → run → sample → detokenize) → `RequestOutput`s. Not thread-safe:
`AsyncEngine` runs it on one thread.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.engine import EngineCore, Request, RequestDelta, SamplingParams, Scheduler
from kvserve.engine.lora import AdapterRef
from kvserve.kvcache import AuditReport, KVCacheStats
from kvserve.model import Tokenizer
from kvserve.model.grammar import Grammars
from kvserve.model.runner import ModelRunner
from kvserve.runtime.collective_stats import CollectiveStats
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.engine_build import build_parts, start_ranks
from kvserve.runtime.engine_info import EngineInfo
from kvserve.runtime.kv_event_log import KVEventLog
from kvserve.runtime.kv_faults import FAULT_VAR as KV_FAULT_VAR
from kvserve.runtime.kv_faults import KVFault
from kvserve.runtime.lora_registry import LoRARegistry
from kvserve.runtime.outputs import CompletionOutput, RequestOutput
from kvserve.runtime.step_tokens import StepTokenCounts, StepTokens
from kvserve.runtime.tp.executor import TensorParallelExecutor
from kvserve.runtime.tp.launch import Rendezvous

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A consistent snapshot for metrics and /debug/kv, taken on the engine's thread."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVCacheStats
    last_audit: AuditReport | None
    step_tokens: StepTokenCounts | None = None
    num_waiting_deferred: int = 0  # of the waiting, those waiting to hit blocks in flight
    running_loras: tuple[str, ...] = ()  # LoRA adapter names of running requests (sorted)
    waiting_loras: tuple[str, ...] = ()  # ... and of waiting ones
    num_waiting_for_adapter: int = 0  # waiting requests the last step left for a LoRA slot


class LLMEngine:
    """Serves one model. Build it with `from_args`."""

    def __init__(
        self,
        info: EngineInfo,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        executor: ModelRunner | TensorParallelExecutor,
        eos_token_ids: frozenset[int],
        *,
        grammars: Grammars | None = None,
        collective_stats: CollectiveStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self.args = info.args
        self.tokenizer = tokenizer
        self.kv_cache = scheduler.kv_cache
        self.executor = executor  # the model side of the core; close/check_ranks/runner
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.grammars = grammars  # compiles structured-output constraints
        self.collective_stats = collective_stats  # tensor parallelism only
        self.last_audit: AuditReport | None = None
        self.core = EngineCore(scheduler, executor, tokenizer, clock, on_audit=self._record_audit)
        self.kv_events = KVEventLog()  # the cache's events, drained each step (/kv/events, ZMQ)
        self.step_tokens = StepTokens()  # tokens computed per step that computed any
        self._outputs: dict[str, RequestOutput] = {}  # live requests by id
        self._child_of: dict[str, tuple[str, int]] = {}  # engine request id -> (id, index)
        # Called on the engine thread as a request's final output leaves `step`, before the
        # next step can reuse its freed blocks (a prefill worker copies the KV out then).
        self._on_finish: dict[str, Callable[[LLMEngine, RequestOutput], None]] = {}
        self.kv_fault = KVFault.from_env()  # None unless a test plants one (KVSERVE_TEST_HOOKS)
        self.lora: LoRARegistry | None = None  # the adapters, with enable_lora

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.limits.max_model_len

    @property
    def model_path(self) -> Path | None:
        return self.info.model_path

    @classmethod
    def from_args(cls, args: EngineArgs, rendezvous: Rendezvous | None = None) -> LLMEngine:
        """Load the model and tokenizer, size and allocate the KV cache, wire the engine
        (runtime/engine_build.py).

        With `tensor_parallel_size` > 1 this process is rank 0: it starts the other ranks
        (where `rendezvous`, default from the environment, says to) and drives them."""
        group = start_ranks(args, rendezvous)
        try:
            parts = build_parts(args, group)
            engine = cls(parts.info, parts.tokenizer, parts.scheduler, parts.executor,
                         parts.eos_token_ids, grammars=parts.grammars,
                         collective_stats=parts.collective_stats)
            engine.lora = parts.lora
            if isinstance(parts.executor, TensorParallelExecutor):
                weakref.finalize(engine, parts.executor.close)  # no rank outlives rank 0
        except BaseException:
            if group is not None:
                group.stop()
            raise
        return engine

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent; a no-op on one rank)."""
        if isinstance(self.executor, TensorParallelExecutor):
            self.executor.close()

    def check_ranks(self) -> None:
        """Raise CollectiveError (rank lost) if another tensor-parallel rank's process on this
        node has exited; a no-op on one rank."""
        if isinstance(self.executor, TensorParallelExecutor):
            self.executor.check_ranks()

    def fail_all(self, error: str) -> None:
        """End every live request with `error`, freeing its blocks, without running a step
        (the model can no longer run: a failed tensor-parallel group, a dead step loop)."""
        self.core.fail_all(error)

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        deadline: float | None = None,
        first_token_deadline: float | None = None,
        arrival_time: float | None = None,
        kv_import: bool = False,
        on_finish: Callable[[LLMEngine, RequestOutput], None] | None = None,
        max_tokens_within_context: bool = False,
        lora: AdapterRef | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (nothing queued) for an empty or too-long prompt,
        token ids outside the vocabulary, or a request id already in use. `kv_import`: the
        request takes over the open KV import of the same id (kvserve.kvcache.imports; n = 1
        only). `on_finish(engine, output)` runs on the engine thread with the final output. A
        `params.structured` constraint that does not compile is a ValueError naming why.
        `deadline` / `first_token_deadline` (engine clock): the request ends with TIMEOUT when
        it is not done / has no output token by then. `max_tokens_within_context`: refuse (as
        vLLM's server does) a prompt plus max_tokens beyond max_model_len, instead of ending
        the output at the context. `lora`: the adapter to run under (None: the base model).
        """
        params = params or SamplingParams()
        if lora is not None and self.lora is None:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora")
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        imports = self.kv_cache.imports
        if kv_import and (params.n != 1 or imports is None or request_id not in imports.imports):
            raise ValueError(f"request {request_id!r} has no open KV import to take (n must "
                             "be 1 and the worker needs a host tier)")
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("this engine has no grammar backend for structured output")
            self.grammars.check(params.structured)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]  # vLLM's: keep the tail
        if (max_tokens_within_context and params.max_tokens is not None
                and len(token_ids) < self.max_model_len  # else: the prompt's own error
                and len(token_ids) + params.max_tokens > self.max_model_len):
            raise ValueError(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {len(token_ids)} "
                f"input tokens ({params.max_tokens} > {self.max_model_len} - {len(token_ids)}); "
                "lower max_tokens or shorten the prompt")
        arrival = self.clock() if arrival_time is None else arrival_time
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=replace(params, n=1, seed=None if params.seed is None
                                        else params.seed + i),
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                deadline=deadline,
                first_token_deadline=first_token_deadline,
                cache_salt=cache_salt,
                lora=lora,
                group_id=request_id if params.n > 1 else None,
            )
            for i in range(params.n)
        ]
        for i, child in enumerate(children):
            try:
                self.core.add_request(child)
            except ValueError:
                self.core.abort(c.request_id for c in children[:i])
                raise
            self._child_of[child.request_id] = (request_id, i)
        self._outputs[request_id] = RequestOutput(
            request_id, token_ids, [CompletionOutput(i) for i in range(params.n)], arrival, text)
        if kv_import:
            assert imports is not None
            imports.attach(request_id)
        if on_finish is not None:
            self._on_finish[request_id] = on_finish

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt; ids given directly are checked against the vocabulary."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.info.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        return token_ids

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples). Unknown or finished ids are ignored."""
        output = self._outputs.get(request_id)
        if output is None:
            return
        n = len(output.outputs)
        self.core.abort([request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block in every tier (KVCacheManager's refusals apply:
        False, nothing changed) and publish the clear now, so KV event consumers see it before
        any later block rather than at the next step."""
        if not self.kv_cache.reset_prefix_cache():
            return False
        self.kv_events.extend(self.kv_cache.drain_events())
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns every request that changed, finished ones last seen here."""
        touched: dict[str, RequestOutput] = {}
        for output in self._outputs.values():
            for completion in output.outputs:
                completion.new_text, completion.new_token_ids, completion.new_logprobs = "", (), ()
        scheduled_before = self.core.counts().num_scheduled_tokens
        if self.kv_fault is not None and (block := self.kv_fault.before_step(
                self.core.running_request_ids, self.kv_cache)) is not None:
            log.warning("test hook %s: reassigned KV block %d under a live request",
                        KV_FAULT_VAR, block)
        for delta in self.core.step():
            if (touched_output := self._apply(delta)) is not None:
                touched[touched_output.request_id] = touched_output
        if (num_tokens := self.core.counts().num_scheduled_tokens - scheduled_before) > 0:
            self.step_tokens.observe(num_tokens)
        self.kv_events.extend(self.kv_cache.drain_events())
        for request_id, output in touched.items():
            if output.finished:
                output.finished_time = self.clock()
                del self._outputs[request_id]
                if (hook := self._on_finish.pop(request_id, None)) is not None:
                    hook(self, output)
        return list(touched.values())

    def _apply(self, delta: RequestDelta) -> RequestOutput | None:
        parent = self._child_of.get(delta.request_id)
        if parent is None:
            return None
        request_id, index = parent
        output = self._outputs[request_id]
        completion = output.outputs[index]
        completion.new_text, completion.new_token_ids = delta.new_text, delta.new_token_ids
        completion.new_logprobs = delta.new_logprobs
        completion.text += delta.new_text
        completion.token_ids.extend(delta.new_token_ids)
        completion.logprobs.extend(delta.new_logprobs)
        output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
        output.num_preemptions = max(output.num_preemptions, delta.num_preemptions)
        if delta.scheduled_time is not None and (output.scheduled_time is None
                                                 or delta.scheduled_time < output.scheduled_time):
            output.scheduled_time = delta.scheduled_time
        if delta.new_token_ids and output.first_token_time is None:
            output.first_token_time = self.clock()
        if delta.prompt_logprobs is not None and output.prompt_logprobs is None:
            output.prompt_logprobs = list(delta.prompt_logprobs)
        if delta.finished:
            completion.finish_reason = delta.finish_reason
            completion.stop_reason = delta.stop_reason
            completion.error = delta.error
            del self._child_of[delta.request_id]
        return output

    # -- views ----------------------------------------------------------------------------

    @property
    def runner(self) -> ModelRunner:
        """The model runner (its device and host KV tensors; rank 0's under tensor
        parallelism)."""
        executor = self.executor
        return executor.runner if isinstance(executor, TensorParallelExecutor) else executor

    @property
    def live_request_ids(self) -> set[str]:
        """Requests the engine holds (waiting or running): the audit's view of who may hold
        blocks."""
        return self.core.live_request_ids

    def stats(self) -> EngineStats:
        counts = self.core.counts()
        return EngineStats(counts.num_running, counts.num_waiting, counts.num_preemptions,
                           self.kv_cache.stats(), self.last_audit, self.step_tokens.snapshot(),
                           counts.num_waiting_deferred, counts.running_loras,
                           counts.waiting_loras, counts.num_waiting_for_adapter)

    def _record_audit(self, report: AuditReport) -> None:
        self.last_audit = report
