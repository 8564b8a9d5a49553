"""Prefix-memoized tokenization for the gateway's exact route keys.

Multi-tenant prompts share long heads (a tenant's system prompt or document) and differ in a
short tail, so tokenizing every prompt from scratch on the event loop repeats the same work.
`TokenMemo` keeps a bounded LRU of recent encodings (text, token ids, character offsets, word
ids) and, for a new text, finds the entry sharing the longest head (entries are indexed by
their first K characters, for a few K), and tokenizes only `text[c:]`, `c` a word boundary of
the entry a window of tokens before the shared length. The tail's first tokens may differ from
the entry's (its warm-up: a Metaspace or Prepend "▁", a prefix space, a lost left context), so
the splice is accepted only when the tail resynchronizes inside the window, which lies in the
shared text: from some token on, the tail's tokens up to the window's end are exactly the
entry's, ids and character spans alike. The ids are then the entry's up to that sync point and
the tail's from it on; otherwise the text is tokenized in full.

Keys are routing hints, so a wrong key would only cost a cache miss, yet the aim is the very
ids of a full tokenization, and the tests pin that equality for several tokenizer families.
"""

from __future__ import annotations

import enum
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenizers import Tokenizer

_PROBES = ("kv cache", "The 2 blocks, again:\n  done.")
_WORDY_PROBE = "alpha beta, gamma 12 delta"


class MemoOutcome(enum.Enum):
    """How one `TokenMemo.encode` call got its ids."""

    EXACT = "exact"  # the very text was memoized
    SPLICE = "splice"  # an entry's head plus a verified tail tokenization
    FALLBACK = "fallback"  # an entry shared a head but the overlap disagreed: full tokenization
    MISS = "miss"  # no entry shared a long enough head (or the memo is off): full tokenization


@dataclass(slots=True)
class MemoStats:
    """Counters since construction: calls by outcome, characters asked for and characters the
    tokenizer actually ran over (tails, failed tails and full texts)."""

    counts: dict[MemoOutcome, int] = field(
        default_factory=lambda: dict.fromkeys(MemoOutcome, 0))
    chars_requested: int = 0
    chars_tokenized: int = 0

    @property
    def num_calls(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True, slots=True)
class MemoLimits:
    """Sizes of the memo. Memory is bounded by `max_entries` and `max_chars` of stored text; a
    fully tokenized entry's ids, spans and word ids (Python objects) add about 190 bytes per
    token, some 20-25 MB at the default limits, and a spliced one shares its head's. A splice
    re-tokenizes from a word boundary `overlap_tokens` tokens before the last entry token that
    ends `margin_chars` before the shared length, and needs the last `sync_tokens` or more of
    that window reproduced exactly; it is stored as an entry of its own only when its tail is
    at least `store_tail_chars` long."""

    max_entries: int = 64
    max_chars: int = 1 << 19
    key_chars: tuple[int, ...] = (64, 512, 4096)
    margin_chars: int = 16
    overlap_tokens: int = 8
    sync_tokens: int = 4
    max_candidates: int = 4
    store_tail_chars: int = 2048

    def __post_init__(self) -> None:
        if min(self.max_entries, self.max_chars, self.margin_chars, self.overlap_tokens,
               self.sync_tokens, self.max_candidates) < 1 or not self.key_chars \
                or min(self.key_chars) < 1 or self.sync_tokens > self.overlap_tokens:
            raise ValueError(f"memo limits must be positive, sync_tokens <= overlap_tokens: "
                             f"{self}")


@dataclass(eq=False, slots=True)
class _Entry:
    """One memoized text's content encoding (no post-processor specials). eq=False: buckets
    remove entries by identity, never by comparing their lists."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in `text`
    words: list[int | None]  # pre-token index of each token


class TokenMemo:
    """`encode(text)` returns `tokenizer.encode(text, add_special_tokens=...).ids`, from memory
    where it can. Not thread-safe: one thread (the gateway's event loop) calls it. The tokenizer
    must not be reconfigured afterwards. With truncation or padding set, or a post-processor
    that does more than wrap the text's ids in fixed special tokens, every call tokenizes in
    full (`is_enabled` is False)."""

    def __init__(self, tokenizer: Tokenizer, *, add_special_tokens: bool,
                 limits: MemoLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.limits = limits or MemoLimits()
        self.stats = MemoStats()
        self._key_chars = sorted(set(self.limits.key_chars), reverse=True)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._buckets: dict[str, list[_Entry]] = {}
        self._num_chars = 0
        wrap = _special_wrap(tokenizer, add_special_tokens)
        self._prefix_ids, self._suffix_ids = wrap or ([], [])
        self.is_enabled = (wrap is not None and tokenizer.truncation is None
                           and tokenizer.padding is None)
        self._single_word = _is_single_word(tokenizer)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_chars(self) -> int:
        """Characters of text held (at most `limits.max_chars`)."""
        return self._num_chars

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` as the tokenizer gives them (a new list each call)."""
        if not self.is_enabled:
            self._count(MemoOutcome.MISS, len(text), len(text))
            return list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
                        .ids)
        return self._prefix_ids + self._content_ids(text) + self._suffix_ids

    def _content_ids(self, text: str) -> list[int]:
        # Invariant: returns encode(text, add_special_tokens=False).ids; an entry's ids are used
        # only up to a sync point after which the tail's tokens reproduced the entry's own.
        entry = self._entries.get(text)
        if entry is not None:
            self._touch(entry)
            self._count(MemoOutcome.EXACT, len(text), 0)
            return entry.ids
        tried = 0
        outcome = MemoOutcome.MISS
        base, shared = self._find(text)
        window = self._window(base, shared) if base is not None else None
        if base is not None and window is not None:
            cut, end = window
            tried = len(text) - base.offsets[cut - 1][1]
            self._touch(base)  # before _splice stores (and may evict) anything
            spliced = self._splice(base, text, cut, end)
            if spliced is not None:
                self._count(MemoOutcome.SPLICE, len(text), tried)
                return spliced
            outcome = MemoOutcome.FALLBACK
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = enc.ids
        self._count(outcome, len(text), tried + len(text))
        self._store(_Entry(text, ids, enc.offsets, enc.word_ids))
        return ids

    def _find(self, text: str) -> tuple[_Entry | None, int]:
        """The entry sharing the longest head with `text` among the most recent candidates of
        the longest key that matches, and the shared length; (None, 0) when none does."""
        for key_len in self._key_chars:
            if len(text) < key_len:
                continue
            bucket = self._buckets.get(text[:key_len])
            if not bucket:
                continue
            best, best_len = bucket[-1], -1
            for entry in reversed(bucket[-self.limits.max_candidates:]):
                n = _common_prefix_len(text, entry.text, key_len)
                if n > best_len:
                    best, best_len = entry, n
            return best, best_len
        return None, 0

    def _window(self, base: _Entry, shared: int) -> tuple[int, int] | None:
        """(cut, end): keep base tokens [0, cut), check tokens [cut, end) against the tail.
        `cut` is a word boundary; token end-1 ends `margin_chars` before the shared length."""
        limit = shared - self.limits.margin_chars
        end = bisect_right(base.offsets, limit, key=_end_of)
        while end > 0 and base.offsets[end - 1][1] > limit:  # offsets out of order: be safe
            end -= 1
        cut = end - self.limits.overlap_tokens
        lowest = max(1, cut - 4 * self.limits.overlap_tokens)
        while cut >= lowest and not self._is_cut(base, cut):
            cut -= 1
        return (cut, end) if cut >= lowest else None

    def _is_cut(self, entry: _Entry, idx: int) -> bool:
        """True when tokenizing entry.text from token `idx`'s left edge may resynchronize: the
        tokens do not overlap there and (for tokenizers with a pre-tokenizer) a word ends."""
        prev_end = entry.offsets[idx - 1][1]
        if prev_end > entry.offsets[idx][0]:
            return False  # inside one character (byte tokens) or overlapping spans
        if self._single_word:
            return True
        left, right = entry.words[idx - 1], entry.words[idx]
        return left is None or right is None or left != right

    def _splice(self, base: _Entry, text: str, cut: int, end: int) -> list[int] | None:
        """Tokenize `text` from base token `cut`'s left edge; when the tail resynchronizes with
        base inside the window (`_resync`), base's ids up to the sync point plus the tail's
        from there on; else None."""
        start = base.offsets[cut - 1][1]
        tail = self.tokenizer.encode(text[start:], add_special_tokens=False)
        tail_ids, tail_offsets = tail.ids, tail.offsets
        sync = self._resync(base, tail_ids, tail_offsets, start, cut, end)
        if sync is None:
            return None
        at, tail_at = sync
        ids = base.ids[:at] + tail_ids[tail_at:]
        if len(text) - start >= self.limits.store_tail_chars:
            words = tail.word_ids
            base_word, tail_word = base.words[at], words[tail_at]
            shift = base_word - tail_word if base_word is not None and tail_word is not None else 0
            self._store(_Entry(
                text, ids,
                base.offsets[:at] + [(a + start, b + start) for a, b in tail_offsets[tail_at:]],
                base.words[:at] + [None if w is None else w + shift for w in words[tail_at:]]))
        return ids

    def _resync(self, base: _Entry, tail_ids: list[int], tail_offsets: list[tuple[int, int]],
                start: int, cut: int, end: int) -> tuple[int, int] | None:
        """(at, tail_at): the first base token `at` in [cut, end - sync_tokens] at whose left
        edge a tail token begins such that from there to `end` the tail's tokens are exactly
        base's (ids and character spans, the tail's shifted by `start`). The tail's tokens
        before `tail_at` (its warm-up: a prepended "▁", a missing left context) are dropped.
        None when the tail never resynchronizes inside the window: the splice would be a guess."""
        for at in range(cut, end - self.limits.sync_tokens + 1):
            if at > cut and base.offsets[at - 1][1] > base.offsets[at][0]:
                continue  # inside one character
            left = base.offsets[at][0] - start
            tail_at = bisect_left(tail_offsets, left, key=_start_of)
            num = end - at
            if (tail_at + num <= len(tail_ids)
                    and tail_ids[tail_at:tail_at + num] == base.ids[at:end]
                    and all((a + start, b + start) == base.offsets[at + n]
                            for n, (a, b) in enumerate(tail_offsets[tail_at:tail_at + num]))):
                return at, tail_at
        return None

    def _store(self, entry: _Entry) -> None:
        size = len(entry.text)
        if size < self._key_chars[-1] or size > self.limits.max_chars:
            return
        old = self._entries.pop(entry.text, None)
        if old is not None:
            self._drop(old)
        self._entries[entry.text] = entry
        self._num_chars += size
        for key_len in self._key_chars:
            if size >= key_len:
                self._buckets.setdefault(entry.text[:key_len], []).append(entry)
        while (len(self._entries) > self.limits.max_entries
               or self._num_chars > self.limits.max_chars):
            _, oldest = self._entries.popitem(last=False)
            self._drop(oldest)

    def _drop(self, entry: _Entry) -> None:
        """Forget `entry` (already out of `_entries`) in the buckets and the character count."""
        self._num_chars -= len(entry.text)
        for key_len in self._key_chars:
            if len(entry.text) < key_len:
                continue
            key = entry.text[:key_len]
            bucket = self._buckets[key]
            bucket.remove(entry)
            if not bucket:
                del self._buckets[key]

    def _touch(self, entry: _Entry) -> None:
        """Most recently used, in the LRU and as the last candidate of each of its buckets."""
        self._entries.move_to_end(entry.text)
        for key_len in self._key_chars:
            if len(entry.text) >= key_len:
                bucket = self._buckets[entry.text[:key_len]]
                if bucket[-1] is not entry:
                    bucket.remove(entry)
                    bucket.append(entry)

    def _count(self, outcome: MemoOutcome, requested: int, tokenized: int) -> None:
        self.stats.counts[outcome] += 1
        self.stats.chars_requested += requested
        self.stats.chars_tokenized += tokenized


def _start_of(span: tuple[int, int]) -> int:
    return span[0]


def _end_of(span: tuple[int, int]) -> int:
    return span[1]


def _common_prefix_len(a: str, b: str, known: int = 0) -> int:
    """Length of the longest common prefix of `a` and `b`, given that the first `known`
    characters agree. Slice compares run in C; about 2 * min(len) characters are copied."""
    lo, hi = known, min(len(a), len(b))
    if a[lo:hi] == b[lo:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _special_wrap(tokenizer: Tokenizer,
                  add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    """(before, after): the ids the post-processor adds around a text's own ids, the same for
    every probe; None when it does anything else (then the memo stays off)."""
    found: tuple[list[int], list[int]] | None = None
    for probe in _PROBES:
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=add_special_tokens).ids
        wrap = next(((full[:p], full[p + len(bare):]) for p in range(len(full) - len(bare) + 1)
                     if full[p:p + len(bare)] == bare), None)
        if not bare or wrap is None or (found is not None and wrap != found):
            return None
        found = wrap
    return found


def _is_single_word(tokenizer: Tokenizer) -> bool:
    """True when the tokenizer does not split text into words (no pre-tokenizer, as in
    sentencepiece-converted BPE): then every token boundary is a candidate cut."""
    words = tokenizer.encode(_WORDY_PROBE, add_special_tokens=False).word_ids
    return len({w for w in words if w is not None}) <= 1
