"""A request as the engine sees it: tokens, progress, state and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.engine.lora import AdapterRef
from kvserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV to be recomputed (prefix hits help)
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended; `openai_name` is what the API reports. A string enum, so code
    written for vLLM's string reasons (`== "length"`) reads it unchanged."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or asked to cancel
    TIMEOUT = "timeout"  # its deadline passed
    ERROR = "error"  # a fault while serving it (corruption detected, model error)

    @property
    def openai_name(self) -> str:
        return _OPENAI_NAMES[self]


_OPENAI_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.TIMEOUT: "abort",
    FinishReason.ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives, best first. `rank`: the token's
    place among all tokens by logprob (1 = the most likely), where it was computed (prompt
    logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(slots=True, eq=False)
class Request:
    """One sequence to generate. `n > 1` requests are split into one `Request` per sample,
    sharing `group_id`, before they reach the scheduler.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler brings it up to
    `num_tokens` under its token budget (prefill and decode are the same operation).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    deadline: float | None = None  # absolute, on the engine's clock
    # Absolute, on the engine's clock: the request ends (TIMEOUT) if it has no output token by
    # then; its client stops waiting for a first token that comes later.
    first_token_deadline: float | None = None
    cache_salt: str | None = None
    lora: AdapterRef | None = None  # the LoRA adapter it runs under (None: the base model)
    group_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from cache at first admission; -1 before
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # vLLM's `stop_reason`: the stop string or stop token id that ended it (None: EOS, length).
    stop_reason: str | int | None = None
    # With `prompt_logprobs`: entry p for prompt token p (None for the first), filled as its
    # prefill chunks run; a recomputed chunk finds its entries already there.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    error: str | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first admitted to the running batch (engine clock)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must not be empty")
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def num_output_tokens_left(self, max_seq_len: int) -> int:
        """Tokens it may still generate before LENGTH ends it: `max_tokens` or the longest
        sequence that can run (<= 0: it is over)."""
        left = max_seq_len - self.num_tokens
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(self.output_token_ids))
        return left

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_output_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
