"""OpenAI request bodies (plus vLLM's extras), validated at the boundary.

Unknown fields are ignored, as OpenAI's and vLLM's servers do, so existing clients work
unchanged; known fields with a wrong type or range are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.chat_template import template_message
from kvserve.engine import SamplingParams

MAX_N = 128  # OpenAI's limit; each sample is an engine request
# Seeds seed a torch.Generator (64-bit); sample i of n uses seed + i.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Below this a temperature only overflows the logits: treat it as greedy (as vLLM does).
MIN_SAMPLING_TEMPERATURE = 1e-5
# top_p and repetition_penalty are applied in float32: smaller values round to 0 there.
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 0.01


def _check_unicode(value: Any) -> None:
    """Raise ValueError for a string (anywhere in a JSON value) that is not valid Unicode: JSON
    allows lone surrogates (\\ud800), tokenizers and templates do not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text must be valid Unicode (lone surrogate at {exc.start})") \
                from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat; `to_sampling_params` maps them to the engine."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # Structured output (kvserve.server.structured reads and checks them)
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def stop_limits_error(self, max_sequences: int, max_chars: int) -> str | None:
        """Why the stop sequences exceed the operator's limits (every generated token is
        matched against each one), or None when they do not."""
        stops = self.stop or []
        if len(stops) > max_sequences:
            return (f"'stop' has {len(stops)} sequences; this server allows at most "
                    f"{max_sequences} (--max-stop-sequences)")
        longest = max((len(s) for s in stops), default=0)
        if longest > max_chars:
            return (f"a 'stop' sequence is {longest} characters long; this server allows at "
                    f"most {max_chars} (--max-stop-chars)")
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, *,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the parameter when a value is out of range."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if 0.0 <= temperature < MIN_SAMPLING_TEMPERATURE:
            temperature = 0.0
        top_p = 1.0 if self.top_p is None else self.top_p
        if 0.0 < top_p < MIN_TOP_P:
            top_p = MIN_TOP_P
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extra
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        # OpenAI requires content on every role but the assistant's (which may carry only
        # tool calls); a template would otherwise render an empty turn.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs 'content'")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to a string (the rule the
        gateway applies too, so it keys a conversation as this worker caches it)."""
        return template_message(self.model_dump(exclude_none=True))


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
