"""How long a request may wait for an admission slot (pure: `gateway.admission` and the
simulator run this same rule).

A request whose client says no timeout waits at most the operator's `queue_timeout_s`. One
whose client says how long it waits (`kvserve.client_timeout`) waits at most that and half of
what is left of its timeout (the worker has the other half), and longer while it can still be
answered in time: up to what is left less the time nine in ten requests have lately taken from
admission to their first byte (`AnswerTimes.recent_s`), never more than `max_queue_wait_s` (the
OpenAI SDKs say 600 s unless told otherwise). Its client asked to be served within that time,
and a 429 costs it more than the wait: the OpenAI SDKs count a 429 against the same
`max_retries` (2 by default) as a timeout, so a request refused three times is lost to its
caller, and the Retry-After sleep may overshoot its turn. Admitted any later, it would start
answering after its client gave up, and its prefill would be for nobody.

The shorter bound stays a floor: where answers take nearly the clients' whole timeout (a storm
far beyond the fleet), waiting only while an answer could still come in time would turn every
wait into an immediate 429 and lose the queue's order. The recent answer time is left once:
twice lengthens the tail, half lets clients time out after admission, each a prefill for
nobody (docs/benchmarks.md, "Gateway").
"""

from __future__ import annotations

from collections import deque

DEFAULT_MAX_QUEUE_WAIT_S = 30.0  # the longest wait for a slot, whatever the client says
ANSWER_SAMPLES = 64  # the last admissions whose time to a first byte `recent_s` reads
MIN_ANSWER_SAMPLES = 8
ANSWER_QUANTILE = 0.9


class AnswerTimes:
    """The last ANSWER_SAMPLES times, in seconds, from admission to a first byte."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=ANSWER_SAMPLES)

    def add(self, seconds: float) -> None:
        self._samples.append(max(0.0, seconds))

    def recent_s(self) -> float | None:
        """Their ANSWER_QUANTILE; None with fewer than MIN_ANSWER_SAMPLES."""
        if len(self._samples) < MIN_ANSWER_SAMPLES:
            return None
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, int(ANSWER_QUANTILE * len(ordered)))]


def max_queue_wait(left_s: float | None, answer_s: float | None, queue_timeout_s: float,
                   max_queue_wait_s: float) -> tuple[float, str]:
    """Seconds a request may wait for a slot, and the reason a 429 gives when it cannot:
    `left_s` is what its client has left of its timeout (None: it said none), `answer_s` the
    recent time from admission to a first byte (None: not known yet)."""
    if left_s is None:
        return queue_timeout_s, "queue timeout"
    floor = min(queue_timeout_s, max(0.0, left_s / 2))
    room = floor if answer_s is None else max(floor, left_s - answer_s)
    if room >= max_queue_wait_s:
        return max_queue_wait_s, "queue timeout"
    return room, "queue timeout" if room == queue_timeout_s else "deadline"
