"""What generation returns: per request, one `CompletionOutput` per sample (n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvserve.engine import FinishReason, TokenLogprob


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `text`/`token_ids` are cumulative; `new_*` are this step's part
    (what a stream sends next). `finish_reason` is set once the sample ended; `stop_reason`
    then names the stop string or stop token id that ended it (None for EOS and length)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    new_text: str = ""
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step. `finished` once every sample ended.

    Times are on the engine's monotonic clock: `arrival_time`, `scheduled_time` (first run, any
    sample), `first_token_time` (any sample), `finished_time`. `num_cached_tokens`: prompt
    tokens served from the prefix cache.
    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`): one entry per prompt token, None
    for the first; set once the prompt is computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    prompt: str | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    scheduled_time: float | None = None  # when the engine first ran it (any sample)
    num_preemptions: int = 0  # the most any sample was preempted
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def snapshot(self) -> RequestOutput:
        """A copy that later engine steps never change (what crosses to another thread)."""
        outputs = [replace(o, token_ids=list(o.token_ids), logprobs=list(o.logprobs))
                   for o in self.outputs]
        return replace(self, outputs=outputs)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
