"""Preemption: how the scheduler makes room when blocks run out, and how a request goes back.

The victim is always the most recently admitted running request, until the one that needs room
fits or is itself the victim. Its KV is swapped to host slots private to it (swap mode, when the
host tier has room: nothing is recomputed) or freed and recomputed on resume (its cached prefix
blocks stay hit-able). Either way it returns to the head of the waiting queue.
"""

from __future__ import annotations

from collections import deque

from kvserve.engine.config import PreemptionMode
from kvserve.engine.request import Request, RequestStatus
from kvserve.kvcache import FreeReason, KVCacheManager


class Preemption:
    """The preemption policy over the scheduler's queues (it owns neither) and its counts.
    Refuses swap mode at construction when the cache has no host tier."""

    def __init__(self, mode: PreemptionMode, kv_cache: KVCacheManager) -> None:
        if mode is PreemptionMode.SWAP and kv_cache.transfers is None:
            raise ValueError("swap preemption copies KV to the host tier, but the cache has "
                             "none; add a host tier or use preemption_mode=recompute")
        self.mode = mode
        self.kv_cache = kv_cache
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of those, by swapping (the rest recompute)

    def allocate_or_preempt(self, request: Request, num_new: int, running: list[Request],
                            waiting: deque[Request], preempted: list[Request]) -> bool:
        """Allocate slots for a running request, preempting the newest runners (appended to
        `preempted`) until it fits. Returns False if `request` itself had to be preempted."""
        while self.kv_cache.allocate_slots(request.request_id, num_new) is None:
            victim = running.pop()
            self.preempt(victim, waiting)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request, waiting: deque[Request]) -> None:
        """Take `request`'s blocks and put it at the head of `waiting`: a swapped-out request
        keeps its computed tokens (a waiting request with computed tokens is swapped out);
        otherwise they are recomputed."""
        if (self.mode is PreemptionMode.SWAP
                and self.kv_cache.swap_out(request.request_id)):
            self.num_swap_preemptions += 1
        else:
            self.kv_cache.free(request.request_id, FreeReason.PREEMPTED)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        waiting.appendleft(request)

    def recompute_later(self, requests: list[Request], running: list[Request],
                        waiting: deque[Request]) -> None:
        """Send admitted requests back to the head of the queue with nothing computed (not
        counted as preemptions): they shared blocks in flight that their step will not write
        after all."""
        for request in reversed(requests):
            running.remove(request)
            self.kv_cache.free(request.request_id, FreeReason.PREEMPTED)
            request.num_computed_tokens = 0
            request.num_cached_tokens = -1
            request.status = RequestStatus.WAITING
            waiting.appendleft(request)
