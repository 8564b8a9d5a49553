"""Test-only KV-cache fault injection, read only under KVSERVE_TEST_HOOKS=1.

`KVSERVE_KV_FAULT="reassign:<step>"` makes the engine, before its <step>-th step that has a
running request holding blocks (counted from 1), hand the last block of the oldest such request
to new content, as an eviction bug does: the block's epoch moves on while the request's table
still lists it. The step's verification must then fail that request, naming the block and both
epochs. One-shot. Without the hook flag the variable is ignored, so a production worker cannot
be made to corrupt its own cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kvcache import KVCacheManager
from kvserve.runtime.tp.faults import HOOKS_FLAG

FAULT_VAR = "KVSERVE_KV_FAULT"


@dataclass(slots=True)
class KVFault:
    """Reassign one live block before the `step`-th step with a running request."""

    step: int
    num_steps_seen: int = 0
    done: bool = field(default=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> KVFault | None:
        env = os.environ if environ is None else environ
        if env.get(HOOKS_FLAG) != "1" or not env.get(FAULT_VAR):
            return None
        kind, _, step = env[FAULT_VAR].partition(":")
        if kind != "reassign" or not step.isdigit() or int(step) < 1:
            raise ValueError(f"{FAULT_VAR}={env[FAULT_VAR]!r}: expected reassign:<step>, "
                             "<step> >= 1")
        return cls(int(step))

    def before_step(self, running_request_ids: Sequence[str],
                    kv_cache: KVCacheManager) -> int | None:
        """Plant the fault if this is its step; the block id reassigned, if any.
        `running_request_ids`: the running batch, oldest first."""
        if self.done:
            return None
        holders = [r for r in running_request_ids
                   if kv_cache.has_request(r) and kv_cache.block_table(r)]
        if not holders:
            return None
        self.num_steps_seen += 1
        if self.num_steps_seen < self.step:
            return None
        self.done = True
        block_id = kv_cache.block_table(holders[0])[-1]
        kv_cache.pool.blocks[block_id].epoch += 1  # what the pool does when it reuses a block
        return block_id
