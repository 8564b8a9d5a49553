"""What vLLM's offline API takes, turned into kvserve's: prompts (text, token ids, vLLM's prompt
dicts), `LLM(...)` keyword arguments, and `use_tqdm` progress bars.

Anything kvserve cannot honour is a ValueError naming it, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# vLLM's dtype spellings -> EngineArgs.dtype (None: kvserve's default for the device).
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
# vLLM LLM(...) arguments that state what kvserve always does (accepted at these values).
ALREADY_SO: dict[str, tuple[object, ...]] = {
    "trust_remote_code": (True, False),  # kvserve never runs a checkpoint's own code
    "enforce_eager": (True, False),  # kvserve always runs eagerly (no CUDA graphs)
    "disable_log_stats": (True, False),  # kvserve logs no periodic stats
    "enable_chunked_prefill": (True, None),  # prefill is always chunked
    "tokenizer_mode": ("auto",),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "cpu_offload_gb": (0, 0.0),
    "swap_space": (None, 0, 0.0),
    "load_format": ("auto", "safetensors"),
}
PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt: text or token ids, and the prefix cache's tenant salt (vLLM's `cache_salt`)."""

    prompt: str | list[int]
    cache_salt: str | None = None


def engine_kwargs(model: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM `LLM(...)` keyword arguments as `EngineArgs` fields (unknown names reach EngineArgs,
    whose TypeError names them)."""
    out = dict(kwargs)
    for name, accepted in ALREADY_SO.items():
        if name in out:
            value = out.pop(name)
            if value not in accepted:
                raise ValueError(f"{name}={value!r} is not supported by kvserve; accepted: "
                                 f"{', '.join(repr(a) for a in accepted)}")
    if out.get("tokenizer") is not None and out["tokenizer"] == model:
        out.pop("tokenizer")  # vLLM's default: the model's own
    if "dtype" in out and out["dtype"] in DTYPES:
        out["dtype"] = DTYPES[out["dtype"]]
    return out


def as_prompt_inputs(prompts: Any) -> list[PromptInput]:
    """A prompt or a list of them, each a string, token ids or a vLLM prompt dict
    ({"prompt": text} or {"prompt_token_ids": [...]}, optionally with "cache_salt")."""
    if isinstance(prompts, str | Mapping):
        return [_one(prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [PromptInput(items)]  # one prompt given as token ids
    return [_one(p) for p in items]


def _one(prompt: Any) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(prompt)
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt dict keys {sorted(unknown)} are not supported (kvserve "
                             "takes 'prompt' or 'prompt_token_ids', and 'cache_salt')")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and "
                             "'prompt_token_ids'")
        salt = prompt.get("cache_salt")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("a prompt dict's 'prompt' must be a string")
            return PromptInput(prompt["prompt"], salt)
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
            raise ValueError("a prompt dict's 'prompt_token_ids' must be a list of integers")
        return PromptInput(list(ids), salt)
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return PromptInput(list(prompt))
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict with 'prompt' "
                     f"or 'prompt_token_ids'; got {type(prompt).__name__}")


class ProgressBar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> object: ...


class _RichBar:
    """A transient rich progress bar with tqdm's two methods, on stderr as tqdm's."""

    def __init__(self, total: int) -> None:
        self._progress = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), transient=True,
                                  console=Console(stderr=True))
        self._task = self._progress.add_task("generate", total=total)
        self._progress.start()

    def update(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(use_tqdm: bool | Callable[..., ProgressBar], total: int) -> ProgressBar:
    """vLLM's `use_tqdm`: True a progress bar, False none, a callable (such as `tqdm.tqdm` or a
    partial of it) is called as `use_tqdm(total=..., desc=...)` and updated once per prompt."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    return _RichBar(total) if use_tqdm else _NoBar()
