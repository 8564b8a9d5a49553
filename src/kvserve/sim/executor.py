"""The simulated model: a `ModelExecutor` that computes nothing and says how long it took.

The simulated worker runs kvserve.engine's own `EngineCore` and `Scheduler`; this executor
stands where the torch runner stands. Each step it samples `OUTPUT_TOKEN_ID` for every request
whose chunk reaches the end of its tokens, and prices the step with the cost model
(`CostProfile.step_s` of its `StepShape`), so scheduling rules exist once, in the engine, and
the simulator only decides how much virtual time a step takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.engine import SampledToken, ScheduledRequest, SchedulerOutput, TokenLogprob
from kvserve.sim.costmodel import CostProfile, StepShape, attention_pairs

OUTPUT_TOKEN_ID = -1
"""Every generated token's id. Greedy decoding of one prompt always gives the same output, and a
constant models that; a block's hash chains its whole prefix, so outputs of different prompts
never share a block. No simulated request has an end-of-sequence token: only `max_tokens` or the
context ends one."""

_SAMPLE = SampledToken(OUTPUT_TOKEN_ID)


def step_shape(scheduled: Sequence[ScheduledRequest]) -> StepShape:
    """The cost model's view of a step: decode tokens (one, past the prompt) and the rest."""
    prefill = pairs = decodes = context = prefill_context = 0
    for item in scheduled:
        start, num_new = item.start, item.num_new_tokens
        if num_new == 1 and start >= item.request.num_prompt_tokens:
            decodes += 1
            context += start + 1
        else:
            prefill += num_new
            pairs += attention_pairs(start, num_new)
            prefill_context += start
    return StepShape(prefill, pairs, decodes, context, prefill_context)


class SimExecutor:
    """Runs steps in zero wall time; `last_shape` and `last_step_s` describe the last one."""

    def __init__(self, cost: CostProfile) -> None:
        self.cost = cost
        self.last_shape = StepShape()
        self.last_step_s = 0.0

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        shape = step_shape(output.scheduled)
        self.last_shape = shape
        self.last_step_s = self.cost.step_s(shape)
        return {item.request.request_id: _SAMPLE for item in output.scheduled if item.sample}

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing per request to forget: every sample is the same token."""

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprob]]]:
        return {}  # simulated requests never ask for prompt logprobs
