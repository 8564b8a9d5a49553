"""When each request was first asked for, so that a resend keeps its place in the queue.

In overload a client whose request got a 429, a 504 or no first byte in time sends the same
request again. Queued by its resend's arrival it would start over at the back, behind requests
that came after it: the oldest requests wait longest, and the tail of time to first token
grows by a queue's length per resend. Admission orders its queue by `since` instead (the first
time the gateway saw the same request), so a resend goes ahead of every request younger than
it, and the clients' retries together keep the order in which they first asked.

A request is recognised by a digest of its tenant salt, path and body bytes: a resend is
byte-identical (the OpenAI SDKs and common HTTP retry layers resend the same body). Contract:
- `since(key, now)` is the time `key` was first seen within the last `ttl_s`, recording `now`
  for a key not seen (or seen longer ago: a later identical request is a new one);
- `served(key)` forgets it once a worker started answering, so the same prompt asked again
  later is not treated as a resend;
- at most `max_keys` are remembered (least recently asked forgotten first), so memory is
  bounded whatever the clients send.
Two clients sending the same bytes at once share a place: both are served in that place's
order, which takes nothing from anyone else.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

DEFAULT_TTL_S = 120.0  # a request resent later than this after its first send is a new one
DEFAULT_MAX_KEYS = 65536  # ~100 bytes each


def request_key(salt: str | None, path: str, raw_body: bytes) -> bytes:
    """The digest that recognises a resend of the same request from the same tenant."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((salt or "").encode())
    digest.update(b"\0")
    digest.update(path.encode())
    digest.update(b"\0")
    digest.update(raw_body)
    return digest.digest()


class Seniority:
    """First-seen times of recent requests, bounded in number and age (module docstring)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if ttl_s <= 0 or max_keys < 1:
            raise ValueError("ttl_s > 0 and max_keys >= 1")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._first_seen: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._first_seen)

    def since(self, key: bytes, now: float) -> float:
        """When `key` was first asked for (`now` if it is new, or its last record expired)."""
        first = self._first_seen.get(key)
        if first is not None and now - first <= self.ttl_s:
            self._first_seen.move_to_end(key)
            return first
        self._first_seen[key] = now
        self._first_seen.move_to_end(key)
        while len(self._first_seen) > self.max_keys:
            self._first_seen.popitem(last=False)
        return now

    def served(self, key: bytes) -> None:
        """A worker started answering `key`: a later identical request is a new one."""
        self._first_seen.pop(key, None)
