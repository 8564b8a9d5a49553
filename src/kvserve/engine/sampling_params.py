"""How to sample a request's tokens and when to stop; validated at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.structured import StructuredOutput, StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules for one request (OpenAI's and vLLM's names and meanings).

    `temperature == 0` is greedy. `seed` makes sampling reproducible whatever else is in the
    batch. `stop` strings never appear in the output, nor does a partial one while streaming.
    `logprobs=k` returns the sampled token's logprob and the top k alternatives per token;
    `prompt_logprobs=k` the same for every prompt token after the first (such a request takes
    no prefix-cache hit: a cached token has no logits). `detokenize=False` returns token ids
    only (no text, so no stop strings). `truncate_prompt_tokens=k` keeps the prompt's last k
    tokens. `best_of` is accepted only equal to `n` (kvserve returns every sample it draws).
    `spaces_between_special_tokens` must stay True: the fast tokenizer's decoder decides.
    `structured`: the output must match it (a grammar masks every sampled token's logits);
    vLLM's `structured_outputs=StructuredOutputsParams(...)` (or its older
    `guided_decoding=GuidedDecodingParams(...)`) sets it.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): all tokens
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    spaces_between_special_tokens: bool = True
    structured: StructuredOutput | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Normalise sequences given as lists or a single string, as OpenAI clients send them.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        given = [p for p in (self.structured_outputs, self.guided_decoding) if p is not None]
        if not all(isinstance(p, StructuredOutputsParams) for p in given):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (and "
                             "guided_decoding a GuidedDecodingParams), from "
                             "kvserve.sampling_params")
        if given:
            constraint = given[0].to_structured()
            # A copy (dataclasses.replace) carries both the params and their constraint.
            if len(given) > 1 or self.structured not in (None, constraint):
                raise ValueError("give one output constraint: structured_outputs, "
                                 "guided_decoding or structured")
            object.__setattr__(self, "structured", constraint)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the parameter and its allowed range."""
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (0.0 <= self.temperature <= 100.0,
             f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (self.detokenize or not self.stop,
             "stop strings need detokenize=True (use stop_token_ids without text)"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}"),
            (self.best_of is None or self.best_of == self.n,
             f"best_of ({self.best_of}) must equal n ({self.n}) or be left out: kvserve "
             "returns every sample it draws and does not rank them"),
            (self.spaces_between_special_tokens,
             "spaces_between_special_tokens=False is not supported: the fast tokenizer's "
             "decoder joins special tokens as tokenizer.json says; leave it True"),
            # The grammar ends the output with EOS once it accepts: nothing may follow it.
            (self.structured is None or not self.ignore_eos,
             "ignore_eos cannot be combined with structured output (the grammar ends the "
             "output with EOS when it is complete)"),
            (self.structured is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured output (the grammar decides the "
             "length)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
