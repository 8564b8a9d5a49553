"""The engine's scheduling rules over a real KVCacheManager, restated for the simulator.

These are kvserve.engine.scheduler's rules, without importing it: one token budget per step;
running requests first (oldest first), then waiting ones first come, first served; chunked
prefill; at most `max_num_seqs` running; when a running request cannot get blocks, the most
recently admitted one is preempted (its blocks freed, its KV recomputed later; its cached
prefix blocks stay hit-able). An admission that cannot be allocated stops the waiting queue. A
waiting request whose next prompt blocks another running request is computing waits and hits
them instead of computing them twice (later ones may go first meanwhile).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.kvcache import FreeReason, KVCacheManager
from kvserve.sim.costmodel import StepShape, attention_pairs
from kvserve.sim.seq import SimSeq

Item = tuple[SimSeq, int, int]
"""One seq's share of a step: (seq, start, num_new): compute tokens [start, start + num_new)."""


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """The scheduler's limits, with vLLM's names."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if min(self.max_num_batched_tokens, self.max_num_seqs) < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


class SimScheduler:
    """Waiting and running seqs over one cache. Single-threaded; the worker owns it."""

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, max_seq_len: int) -> None:
        self.limits = limits
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.num_preemptions = 0

    def schedule(self) -> tuple[list[Item], bool]:
        """One step's items (their slots allocated), and whether it is a plain decode step
        (nothing admitted or preempted, every item one decode token): one that may be
        fast-forwarded, since repeating it changes nothing but the seqs' lengths."""
        # Invariant: the items' tokens never exceed the budget; every item has its slots.
        kv = self.kv
        budget = self.limits.max_num_batched_tokens
        items: list[Item] = []
        preempted = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            fits = True
            while kv.allocate_slots(seq.seq_id, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    fits = False
                    break
            if not fits:
                break  # the seq itself was preempted: everything after it already was
            items.append((seq, seq.num_computed, num_new))
            budget -= num_new
            idx += 1
        is_plain_decode = not preempted and all(
            n == 1 and s + 1 == seq.num_tokens and s >= seq.num_prompt_tokens
            for seq, s, n in items)
        skipped: list[SimSeq] = []
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.limits.max_num_seqs:
                break
            seq = self.waiting[0]
            if not kv.has_request(seq.seq_id):
                tokens = seq.prompt if seq.num_output == 0 else seq.all_token_ids()
                kv.add_request(seq.seq_id, tokens, cache_salt=seq.tenant)
            hit = kv.lookup(seq.seq_id)
            if hit.num_pending_tokens:
                skipped.append(self.waiting.popleft())
                continue
            num_new = min(seq.num_tokens - hit.num_tokens, budget)
            if kv.allocate_slots(seq.seq_id, num_new, hit) is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.num_computed = hit.num_tokens
            if seq.num_cached < 0:
                seq.num_cached = hit.num_tokens
            self.running.append(seq)
            items.append((seq, seq.num_computed, num_new))
            budget -= num_new
            is_plain_decode = False
        self.waiting.extendleft(reversed(skipped))
        return items, is_plain_decode and bool(items)

    def remove(self, seq: SimSeq) -> None:
        """Take `seq` out of the running list or the waiting queue (wherever it is)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def decode_run_length(self, items: list[Item]) -> int:
        """How many identical decode steps can run from a plain decode step with nothing
        changing: until the first seq finishes, and no further than the free blocks allow
        (the steps after the first allocate only at block boundaries)."""
        bs = self.kv.block_size
        steps = min(min(seq.max_tokens - seq.num_output, self.max_seq_len - seq.num_tokens)
                    for seq, _, _ in items)
        free = self.kv.pool.num_free_blocks

        def extra_blocks(num_steps: int) -> int:  # beyond what step 1 already allocated
            return sum(-(-(seq.num_tokens - 1 + num_steps) // bs) - -(-seq.num_tokens // bs)
                       for seq, _, _ in items)

        if extra_blocks(steps) <= free:
            return max(steps, 1)
        lo, hi = 1, steps  # the largest m with extra_blocks(m) <= free
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra_blocks(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self, seq: SimSeq) -> None:
        self.kv.free(seq.seq_id, FreeReason.PREEMPTED)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def step_shape(items: list[Item]) -> StepShape:
    """The cost model's view of a step: decode tokens (one, past the prompt) and the rest."""
    prefill = pairs = decodes = context = prefill_context = 0
    for seq, start, num_new in items:
        if num_new == 1 and start >= seq.num_prompt_tokens:
            decodes += 1
            context += start + 1
        else:
            prefill += num_new
            pairs += attention_pairs(start, num_new)
            prefill_context += start
    return StepShape(prefill, pairs, decodes, context, prefill_context)
