"""Test-only fault injection for tensor-parallel ranks, read only under KVSERVE_TEST_HOOKS=1.

`KVSERVE_TP_FAULT="<rank>:<step>:<kind>[:<seconds>]"` makes rank <rank> (never 0), at step
<step>: `delay` sleep <seconds> before its forward pass (a slow rank), `exit` die at once (a lost
rank), `diverge` alter one block-table entry of the plan it received (a divergent rank).
`<step>` may be a range `<first>-<last>` (inclusive): a rank that stays slow for many steps. Without
the hook flag the variable is ignored, so a production worker cannot be made to misbehave.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from enum import Enum

from kvserve.model.step_plan import StepPlan

HOOKS_FLAG = "KVSERVE_TEST_HOOKS"
FAULT_VAR = "KVSERVE_TP_FAULT"
LOST_RANK_EXIT_CODE = 17


class FaultKind(Enum):
    DELAY = "delay"
    EXIT = "exit"
    DIVERGE = "diverge"


@dataclass(frozen=True, slots=True)
class Fault:
    """One planted fault: `kind` on `rank` at step `step_id`."""

    rank: int
    step_id: int
    kind: FaultKind
    seconds: float = 0.0
    last_step_id: int | None = None  # a range of steps ends here (None: only `step_id`)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Fault | None:
        env = os.environ if environ is None else environ
        if env.get(HOOKS_FLAG) != "1" or not env.get(FAULT_VAR):
            return None
        parts = env[FAULT_VAR].split(":")
        try:
            first, _, last = parts[1].partition("-")
            return cls(int(parts[0]), int(first), FaultKind(parts[2]),
                       float(parts[3]) if len(parts) > 3 else 0.0,
                       int(last) if last else None)
        except (IndexError, ValueError) as exc:
            raise ValueError(f"{FAULT_VAR}={env[FAULT_VAR]!r}: expected "
                             "rank:step[-last]:delay|exit|diverge[:seconds]") from exc

    def applies(self, rank: int, step_id: int) -> bool:
        last = self.step_id if self.last_step_id is None else self.last_step_id
        return rank == self.rank and self.step_id <= step_id <= last

    def before_check(self, rank: int, plan: StepPlan) -> StepPlan:
        """What rank `rank` executes instead of `plan` (or dies, or waits) under this fault."""
        if not self.applies(rank, plan.step_id):
            return plan
        if self.kind is FaultKind.EXIT:
            os._exit(LOST_RANK_EXIT_CODE)
        if self.kind is FaultKind.DIVERGE and plan.block_tables:
            first = plan.block_tables[0]
            return replace(plan, block_tables=((first[0] + 1, *first[1:]), *plan.block_tables[1:]))
        return plan

    def before_forward(self, rank: int, plan: StepPlan) -> None:
        if self.kind is FaultKind.DELAY and self.applies(rank, plan.step_id):
            time.sleep(self.seconds)
