"""The simulated model: a `ModelExecutor` that computes nothing and says how long it took.

The simulated worker runs kvserve.engine's own `EngineCore` and `Scheduler`; this executor
stands where the torch runner stands. Each step it samples `OUTPUT_TOKEN_ID` for every request
whose chunk reaches the end of its tokens, and prices the step with the cost model
(`CostProfile.step_s` of its `StepShape`), so scheduling rules exist once, in the engine, and
the simulator only decides how much virtual time a step takes. With LoRA adapters, a step
that runs one not in a device slot loads it first (`adapters.AdapterSlots`), `adapter_load_s`
each, before the step's own time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.engine import SampledToken, ScheduledRequest, SchedulerOutput, TokenLogprob
from kvserve.sim.adapters import AdapterSlots
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
    """Runs steps in zero wall time; `last_shape`, `last_step_s` and `last_num_loads` (adapters
    loaded before it) describe the last one."""

    def __init__(self, cost: CostProfile, slots: AdapterSlots | None = None,
                 adapter_load_s: float = 0.0) -> None:
        self.cost = cost
        self.slots = slots
        self.adapter_load_s = adapter_load_s
        self.last_shape = StepShape()
        self.last_step_s = 0.0
        self.last_num_loads = 0

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        shape = step_shape(output.scheduled)
        self.last_shape = shape
        self.last_step_s = self.cost.step_s(shape)
        if self.slots is not None:
            self.last_num_loads = self.slots.use(
                item.request.lora.digest for item in output.scheduled
                if item.request.lora is not None)
            self.last_step_s += self.last_num_loads * self.adapter_load_s
        return {item.request.request_id: _SAMPLE for item in output.scheduled if item.sample}

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing per request to forget: every sample is the same token."""

    def take_prompt_logprobs(self) -> dict[str, list[tuple[int, TokenLogprob]]]:
        return {}  # simulated requests never ask for prompt logprobs
