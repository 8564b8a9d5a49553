"""Simulated clients: one per trace request, with the behaviour of real ones.

A patient client (`ttft_timeout_s` None) waits for its answer however long it takes. An
impatient one cancels an attempt that has not produced its first token within `ttft_timeout_s`
and sends the same prompt again, up to `max_retries` times, then gives up: the retry storm of
the incident. Either kind honours a 429's Retry-After: it waits, then sends again (not counted
as a retry; the gateway did no work for it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.lora import AdapterRef
from kvserve.gateway.core.admission_core import Ticket
from kvserve.gateway.core.lifecycle import Dispatch
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.sim.seq import SimSeq
from kvserve.workload import TraceRequest


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How clients behave; the default is patient (no timeout, no retry)."""

    ttft_timeout_s: float | None = None
    max_retries: int = 0

    def __post_init__(self) -> None:
        if self.ttft_timeout_s is not None and self.ttft_timeout_s <= 0:
            raise ValueError("ttft_timeout_s must be positive (None: no timeout)")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")

    @classmethod
    def retrying(cls, ttft_timeout_s: float = 5.0, max_retries: int = 3) -> ClientConfig:
        """The incident's clients: time out at 5 s without a first token, resend."""
        return cls(ttft_timeout_s, max_retries)


class Outcome(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    GAVE_UP = "gave_up"  # timed out after its last retry
    REJECTED = "rejected"  # the worker can never run the prompt (400)


@dataclass(slots=True, eq=False)
class ClientRequest:
    """One user request across all its attempts. Times are from its arrival (the user's view:
    retries and 429 waits included). `prompt` is held only while the request is pending."""

    trace: TraceRequest
    arrival: float
    route: RouteRequest | None = None
    adapter: AdapterRef | None = None  # its tenant's LoRA adapter (None: the base model)
    prompt: list[int] | None = None
    num_attempts: int = 0
    num_retries: int = 0  # timeouts that resent
    num_throttled: int = 0  # 429s honoured
    first_token_at: float | None = None
    finished_at: float | None = None
    num_cached_tokens: int = 0  # prefix hit of the attempt that answered
    outcome: Outcome = Outcome.PENDING

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival


@dataclass(slots=True, eq=False)
class Attempt:
    """One send of a request. It ends exactly once: answered, cancelled by the client's
    timeout, refused with 429, or rejected."""

    request: ClientRequest
    number: int
    sent_at: float
    seq: SimSeq | None = None
    worker_id: str | None = None
    dispatch: Dispatch | None = None  # its gateway bookkeeping, once sent (SimGateway.dispatch)
    ticket: Ticket | None = None  # its admission at the gateway (None: no admission)
    is_over: bool = False
    dispatched_at: float = 0.0  # when it went upstream (after any wait for admission)
