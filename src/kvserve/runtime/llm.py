"""The offline API: `LLM(model=...).generate(prompts, params)`, with vLLM's arguments."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvserve.chat_template import open_final_message, template_argument
from kvserve.engine import SamplingParams
from kvserve.engine.lora import AdapterRef
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.llm_engine import LLMEngine
from kvserve.runtime.llm_inputs import (
    ProgressBar,
    PromptInput,
    as_prompt_inputs,
    engine_kwargs,
    progress_bar,
)
from kvserve.runtime.lora_request import LoRARequest
from kvserve.runtime.outputs import RequestOutput

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Batch generation with continuous batching over the paged, prefix-cached KV cache.

    `LLM()` runs the default model (SmolLM2-135M-Instruct, runtime/default_model);
    `LLM(model="Qwen/Qwen2.5-0.5B-Instruct")`, a local directory or a GGUF file runs another.
    Keyword arguments are `EngineArgs` fields, plus vLLM's that state what kvserve always does
    (`trust_remote_code`, `enforce_eager`, ...; see runtime/llm_inputs); one kvserve cannot
    honour is a ValueError naming it.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(EngineArgs(model=model,
                                                     **engine_kwargs(model, engine_args)))
        self._next_id = 0

    def close(self) -> None:
        """Stop the other tensor-parallel ranks now (they also stop when this object goes)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        """vLLM's name for `tokenizer`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., ProgressBar] = True,
        *,
        use_progress: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is text, token ids, or a vLLM prompt dict (`{"prompt": text}` or
        `{"prompt_token_ids": ids}`, optionally with `"cache_salt"`). One `SamplingParams`
        applies to all prompts; a list gives one per prompt. `use_tqdm`: as vLLM's (True, False
        or a tqdm-like callable); `use_progress` is kvserve's older name for it.
        `lora_request`: vLLM's `LoRARequest` for every prompt, or a list of one per prompt
        (None: the base model); needs `LLM(..., enable_lora=True)`.
        """
        batch = as_prompt_inputs(prompts)
        return self._run(batch, sampling_params,
                         use_tqdm if use_progress is None else use_progress,
                         self._adapters(lora_request, len(batch)))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., ProgressBar] = True,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`: a file or the template) to
        one conversation or a list of them, then generate; vLLM's arguments and meanings.
        `continue_final_message` renders the last (assistant) message open, to be continued."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format must be 'auto' or 'string': "
                             "kvserve flattens text parts to a string")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "True (pass add_generation_prompt=False)")
        tokenizer = self.engine.tokenizer
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(template_argument(chat_template))
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation), add_generation_prompt=add_generation_prompt, tools=tools,
                **dict(chat_template_kwargs or {}))
            if continue_final_message:
                text = open_final_message(text, list(conversation))
            prompts.append(PromptInput(tokenizer.encode(text, add_special_tokens=False)))
        return self._run(prompts, sampling_params,
                         use_tqdm if use_progress is None else use_progress,
                         self._adapters(lora_request, len(prompts)))

    def _adapters(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                  num_prompts: int) -> list[AdapterRef | None]:
        """One adapter (or None) per prompt, registered with the engine on first sight."""
        registry = self.engine.lora
        if lora_request is None:
            return [None] * num_prompts
        if registry is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * num_prompts
        elif isinstance(lora_request, Sequence):
            requests = list(lora_request)
            if len(requests) != num_prompts:
                raise ValueError(f"got {len(requests)} lora requests for {num_prompts} prompts")
        else:
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, got "
                            f"{type(lora_request).__name__}")
        refs: list[AdapterRef | None] = []
        for r in requests:
            if r is not None and not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(r).__name__}")
            refs.append(None if r is None else registry.resolve_request(
                r.lora_name, r.lora_path, r.lora_int_id, r.base_model_name))
        return refs

    def _run(self, batch: list[PromptInput],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool | Callable[..., ProgressBar],
             adapters: Sequence[AdapterRef | None] = ()) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
        ids = []
        for i, (item, p) in enumerate(zip(batch, params, strict=True)):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, item.prompt, p, cache_salt=item.cache_salt,
                                    lora=adapters[i] if adapters else None)
            ids.append(request_id)
        done: dict[str, RequestOutput] = {}
        bar = progress_bar(use_tqdm, len(ids))
        try:
            while self.engine.has_unfinished:
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        finally:
            bar.close()
        return [done[i] for i in ids]

