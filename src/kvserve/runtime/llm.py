"""The offline API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvserve.engine import SamplingParams
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.llm_engine import LLMEngine
from kvserve.runtime.outputs import RequestOutput

Prompt = str | Sequence[int]


class LLM:
    """Batch generation with continuous batching over the paged, prefix-cached KV cache.

    `LLM()` runs the built-in demo model; `LLM(model="Qwen/Qwen2.5-0.5B-Instruct")` or a local
    directory runs a real checkpoint. Keyword arguments are `EngineArgs` fields.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_args))
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

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_progress: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        One `SamplingParams` applies to all prompts; a list gives one per prompt.
        """
        batch = _as_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"got {len(params)} sampling params for {len(batch)} prompts")
        ids = []
        for prompt, p in zip(batch, params, strict=True):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        done: dict[str, RequestOutput] = {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), disable=not use_progress, transient=True) as progress:
            task = progress.add_task("generate", total=len(ids))
            while self.engine.has_unfinished:
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        progress.advance(task)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.encode_chat(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, **kwargs)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items
