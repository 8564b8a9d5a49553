"""Incremental detokenization with stop strings that never leak, even partially.

Text is produced token by token with the offset method: decode a short window of recent tokens
and emit only what became stable, so multi-byte characters split across tokens are never emitted
half-done. A suffix of the text that could still grow into a stop string is held back until it
either completes the stop string (and is cut) or cannot (and is released).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

INCOMPLETE_CHAR = "\ufffd"  # what decoders give for a byte sequence cut mid-character
WINDOW = 6  # tokens of context kept before the new ones, so merges across tokens decode right


class TokenDecoder(Protocol):
    """The one thing the engine needs of a tokenizer."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text deltas.

    Contract: the concatenation of every delta returned equals the final text; no delta contains
    any part of a stop string (unless `include_stop_str_in_output`); after a stop string matches,
    `stopped` is True and further tokens are ignored.
    """

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        # Seed the window with the prompt's tail so the first output token decodes in context.
        self._tokens = list(prompt_token_ids[-WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # all stable text so far, stop string excluded once matched
        self._emitted = 0  # chars of `text` already returned
        self.stopped = False
        self.matched_stop: str | None = None

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; returns the text that may be shown now (maybe empty)."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if full.endswith(INCOMPLETE_CHAR) or len(full) <= len(prefix):
            return self._release(final=False)  # nothing stable yet
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._check_stop(len(full) - len(prefix))
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """At the end of the request: whatever was held back, now released."""
        return self._release(final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self._skip_special)

    def _check_stop(self, num_new_chars: int) -> None:
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        start = max(0, len(self.text) - num_new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            self.text = self.text[: idx + len(stop) if self._include_stop else idx]
            self.stopped = True
            self.matched_stop = stop

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held
