"""One attempt of a request on a simulated worker, and how the worker reports on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.lora import AdapterRef


@dataclass(slots=True, eq=False)
class SimSeq:
    """What the fleet hands a worker and reads back: the prompt, how long the answer is, and
    what happened to it. The engine's `Request` (made by the worker) holds the progress.

    `prompt` is shared with the workload and never mutated. `num_cached` is the prefix hit at
    first admission (-1 before); `num_work_tokens` counts tokens computed for this seq,
    recomputation included.
    """

    seq_id: str
    prompt: Sequence[int]
    max_tokens: int
    tenant: str | None
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under (None: the base model)
    num_cached: int = -1
    num_work_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    is_finished: bool = False

    def __post_init__(self) -> None:
        if not self.prompt or self.max_tokens < 1:
            raise ValueError(f"seq {self.seq_id!r}: needs a prompt and max_tokens >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


class WorkerListener(Protocol):
    """What a worker tells its owner, after a step's effects are all applied."""

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        """`seq` produced its first token at `now` (once per seq). An abort takes effect
        between steps, so a seq aborted during its last prefill step still reports it."""
        ...

    def on_finish(self, seq: SimSeq, now: float) -> None:
        """`seq` generated its last token at `now`; its blocks are already free."""
        ...
