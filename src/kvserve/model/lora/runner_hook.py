"""What the model runner does about adapters each step: load the step's adapters into slots
and group the rows by adapter, then clear the grouping after the forward pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.engine import ScheduledRequest
from kvserve.engine.lora import AdapterRef
from kvserve.model.lora.peft_format import LoRAWeights
from kvserve.model.lora.slots import AdapterSlots, SlotAssignment


class RunnerAdapters:
    """`resolve(ref)` gives an adapter's weights in host memory (the runtime's registry, which
    may reload them from disk); `on_rows(name, rows)` counts the rows each adapter ran."""

    def __init__(self, slots: AdapterSlots, resolve: Callable[[AdapterRef], LoRAWeights],
                 on_rows: Callable[[str, int], None] | None = None) -> None:
        self.slots, self.resolve, self.on_rows = slots, resolve, on_rows

    def begin_step(self, scheduled: Sequence[ScheduledRequest],
                   query_start: Sequence[int]) -> SlotAssignment:
        """Before the forward pass: every row of sequence i runs its request's adapter. The
        returned assignment is what other tensor-parallel ranks `follow`."""
        refs: dict[bytes, AdapterRef] = {}
        seq_digests: list[bytes | None] = []
        for item in scheduled:
            ref = item.request.lora
            seq_digests.append(None if ref is None else ref.digest)
            if ref is not None:
                refs.setdefault(ref.digest, ref)
                if self.on_rows is not None:
                    self.on_rows(ref.name, item.num_new_tokens)
        return self.slots.begin_step(seq_digests, query_start,
                                     lambda d: self.resolve(refs[d]))

    def end_step(self) -> None:
        self.slots.end_step()
