"""One attempt of a request on a simulated worker, and how the worker reports on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

OUTPUT_TOKEN_ID = -1
"""Every generated token's id. Greedy decoding of one prompt always gives the same output, and a
constant models that; a block's hash chains its whole prefix, so outputs of different prompts
never share a block."""


@dataclass(slots=True, eq=False)
class SimSeq:
    """The engine's `Request`, reduced to what scheduling and the KV cache need.

    `prompt` is shared with the workload and never mutated; generated tokens exist only as a
    count (`num_tokens - len(prompt)`, all `OUTPUT_TOKEN_ID`). `num_computed` counts tokens whose
    KV is written; `num_cached` is the prefix hit at first admission (-1 before).
    """

    seq_id: str
    prompt: Sequence[int]
    max_tokens: int
    tenant: str | None
    num_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    num_cached: int = -1
    num_preemptions: int = 0
    num_work_tokens: int = 0  # tokens computed for this seq, recomputation included
    first_token_at: float | None = None
    finished_at: float | None = None
    is_finished: bool = False

    def __post_init__(self) -> None:
        if not self.prompt or self.max_tokens < 1:
            raise ValueError(f"seq {self.seq_id!r}: needs a prompt and max_tokens >= 1")
        self.num_tokens = len(self.prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a fresh list)."""
        return [*self.prompt, *([OUTPUT_TOKEN_ID] * (self.num_tokens - len(self.prompt)))]


class WorkerListener(Protocol):
    """What a worker tells its owner. Called from inside the worker's step handling."""

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        """`seq` produced its first token at `now` (once per seq). An abort takes effect
        between steps, so a seq aborted during its last prefill step still reports it."""
        ...

    def on_finish(self, seq: SimSeq, now: float) -> None:
        """`seq` generated its last token at `now`; its blocks are already free."""
        ...
