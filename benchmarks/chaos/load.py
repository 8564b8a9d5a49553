"""Open-loop multi-tenant load through the `openai` SDK, with real client behaviour: the SDK's
own retries and timeouts, streams the client hangs up on mid-way, requests aborted by a short
timeout and resent, and fail-over to the next entry point when one refuses connections.

Each request's outcome is one of: `answered` (first try), `retried` (answered after an SDK
retry, a resend or a fail-over), `clean_error` (an HTTP error status the client can act on),
`lost` (no answer and no status within every try: a hang, a reset, a truncated stream), or
`hung_up` (the client itself disconnected, as planned). Arrivals are a Poisson process at
`rps` whatever the fleet does (open loop); `max_in_flight` bounds the threads, and an arrival
beyond it is counted `shed` by the harness (never silently dropped)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

REQUEST_TIMEOUT_S = 30.0
SDK_RETRIES = 2
_local = threading.local()
TENANT_TEXT = ["The lease says the tenant pays for water. ", "Recipe: flour, eggs, milk. ",
               "Ship log, day nine: calm seas. ", "Unit test report for the parser. "]


@dataclass
class Outcome:
    began: float  # unix seconds
    ended: float
    tenant: int
    entry: str
    kind: str  # plain | stream | hangup | abort_resend
    outcome: str
    attempts: int
    status: int | None
    error: str

    @property
    def latency_s(self) -> float:
        return self.ended - self.began


class Truncated(Exception):
    """An answer that ended without saying it was finished (neither a finish reason nor an
    error): what a client cannot act on."""


def _count_attempt(request: object) -> None:
    _local.attempts = getattr(_local, "attempts", 0) + 1


class Load:
    def __init__(self, entries: dict[str, str], model: str, rps: float, out: Path,
                 seed: int = 0, max_in_flight: int = 48) -> None:
        self.entries, self.model, self.rps = entries, model, rps
        self.rng = random.Random(seed)
        self.clients = {name: self._client(url, SDK_RETRIES, REQUEST_TIMEOUT_S)
                        for name, url in entries.items()}
        self.short = {name: self._client(url, 0, 0.3) for name, url in entries.items()}
        self.pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="client")
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.outcomes: list[Outcome] = []
        self.shed = 0
        self._lock = threading.Lock()
        self._focus: str | None = None  # an entry that takes half the arrivals for a while
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._log = (out / "requests.jsonl").open("a", encoding="utf-8")
        self._thread = threading.Thread(target=self._arrivals, daemon=True, name="arrivals")

    @staticmethod
    def _client(url: str, retries: int, timeout: float) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(event_hooks={"request": [_count_attempt]})
        return openai.OpenAI(base_url=f"{url}/v1", api_key="chaos", max_retries=retries,
                             timeout=timeout, http_client=http)

    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_s: float = 90.0) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.quiesce(drain_s)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._log.close()

    def focus(self, name: str | None, url: str | None = None) -> None:
        """Send half the arrivals straight to `url` (a worker a fault needs busy: a client
        that bypasses the gateways), as entry `name`; None ends it."""
        if name is not None and url is not None and name not in self.clients:
            self.clients[name] = self._client(url, SDK_RETRIES, REQUEST_TIMEOUT_S)
            self.short[name] = self._client(url, 0, 0.3)
        self._focus = name

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def quiesce(self, timeout_s: float) -> bool:
        """Pause arrivals and wait (bounded) until no request is in flight."""
        self.pause()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if self.in_flight == 0:
                    return True
            time.sleep(0.1)
        return False

    def _arrivals(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.rng.expovariate(self.rps)
            time.sleep(max(0.0, next_at - time.monotonic()))
            if self._paused.is_set():
                next_at = time.monotonic()
                continue
            with self._lock:
                if self.in_flight >= self.max_in_flight:
                    self.shed += 1
                    continue
                self.in_flight += 1
            tenant = self.rng.randrange(len(TENANT_TEXT))
            kind = self.rng.choices(["plain", "stream", "hangup", "abort_resend"],
                                    [70, 15, 8, 7])[0]
            order = list(self.entries)
            self.rng.shuffle(order)
            focus = self._focus
            if focus is not None and self.rng.random() < 0.5:
                order = [focus, *order]  # and a gateway next, should the worker refuse
            self.pool.submit(self._one, tenant, kind, order, self.rng.randrange(1 << 30))

    def _one(self, tenant: int, kind: str, order: Sequence[str], seed: int) -> None:
        _local.attempts = 0
        began = time.time()
        # A tenant's shared prefix, then a question of its own: two clients never send the
        # same bytes (a gateway takes byte-identical requests for one client's resend).
        prompt = TENANT_TEXT[tenant] * 6 + f"Question {seed}: say something."
        outcome, status, error, entry = "lost", None, "", order[0]
        try:
            for i, entry in enumerate(order[:2]):  # fail over once, as a client with two URLs
                try:
                    if kind == "abort_resend":
                        # aborted by its 0.3 s timeout (or answered 504 by a gateway that
                        # knew it could not answer in time): resent below, as a client does
                        with contextlib.suppress(openai.APITimeoutError, openai.APIStatusError):
                            self._complete(self.short[entry], prompt, False, False)
                    outcome = self._complete(self.clients[entry], prompt,
                                             kind in ("stream", "hangup"), kind == "hangup")
                    if outcome == "answered" and (_local.attempts > 1 or i > 0
                                                  or kind == "abort_resend"):
                        outcome = "retried"
                    break
                except openai.APIStatusError as exc:
                    outcome, status = "clean_error", exc.status_code
                    error = str(exc)[:200]
                    break
                except (openai.APIConnectionError, Truncated) as exc:
                    outcome, error = "lost", f"{type(exc).__name__}: {exc}"[:200]
                except openai.APIError as exc:  # an error event in a stream: said, not lost
                    outcome, error = "clean_error", f"{type(exc).__name__}: {exc}"[:200]
                    break
        finally:
            done = Outcome(began, time.time(), tenant, entry, kind, outcome,
                           getattr(_local, "attempts", 0), status, error)
            with self._lock:
                self.in_flight -= 1
                self.outcomes.append(done)
                self._log.write(json.dumps(asdict(done)) + "\n")

    def _complete(self, client: openai.OpenAI, prompt: str, stream: bool, hangup: bool) -> str:
        max_tokens = 8 + (len(prompt) % 9)
        if not stream:
            out = client.completions.create(model=self.model, prompt=prompt,
                                            max_tokens=max_tokens, temperature=0)
            if not out.choices or out.choices[0].finish_reason is None:
                raise Truncated("an answer without a finish reason")
            return "answered"
        chunks, finished = 0, False
        with client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True) as events:
            for event in events:
                chunks += 1
                finished = finished or any(c.finish_reason for c in event.choices)
                if hangup and chunks >= 2:
                    return "hung_up"  # closing the stream hangs up mid-answer
        if not finished:
            raise Truncated(f"stream ended after {chunks} chunks, unfinished")
        return "answered"
