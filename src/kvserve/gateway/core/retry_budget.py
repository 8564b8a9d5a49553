"""A retry budget: retries may add at most `ratio` of the request rate (plus a small floor), so a
failing fleet sees fewer retries, not a storm of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RetryBudget:
    """Token bucket: each request deposits `ratio` tokens, each retry spends one; the balance is
    capped at `max_balance`. `min_per_s` tokens accrue per second regardless."""

    ratio: float = 0.1
    min_per_s: float = 1.0
    max_balance: float = 20.0
    balance: float = 5.0
    last: float = 0.0
    retries: int = 0
    denied: int = 0

    def on_request(self, now: float) -> None:
        self._refill(now)
        self.balance = min(self.max_balance, self.balance + self.ratio)

    def try_spend(self, now: float) -> bool:
        self._refill(now)
        if self.balance >= 1.0:
            self.balance -= 1.0
            self.retries += 1
            return True
        self.denied += 1
        return False

    def _refill(self, now: float) -> None:
        if self.last:
            self.balance = min(self.max_balance,
                               self.balance + (now - self.last) * self.min_per_s)
        self.last = now
