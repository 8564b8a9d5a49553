"""Structured output with llguidance: grammars compiled per constraint (a bounded LRU), one
matcher per live request, and the token mask applied to a step's logits before sampling.

llguidance rather than xgrammar: it depends on nothing (xgrammar requires torch, transformers
and triton, a second torch stack beside ours), and it computes masks lazily, so a new schema
costs no compile pause (docs/operations.md has the measurements).

A matcher follows the request's committed output tokens, never the tokens it was asked to
sample: before each mask it consumes what the request gained since (or rolls back what it lost),
so a step that failed, a preemption by recompute or a swap leaves it consistent.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from kvserve.engine import Request, StructuredKind, StructuredOutput
from kvserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the stubs only

DEFAULT_CACHE_SIZE = 256
# JSON without free whitespace: a weak or random model could otherwise fill its whole budget
# with spaces inside a valid document (vLLM's --structured-outputs-config
# disable_any_whitespace). Items and keys keep one space, as json.dumps writes them.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint llguidance cannot compile: the message names what is wrong or unsupported."""


class Grammars:
    """Compiles constraints for one tokenizer; thread-safe (the server checks, the engine
    thread matches). The tokenizer's token table (about a second for a 150k vocabulary) is
    built on first use, or ahead of it by `prepare_in_background`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.num_compiled = 0  # compilations so far (cache misses)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab_size,
                    eos_token=self._eos or None)
            return self._ll_tokenizer

    def prepare_in_background(self) -> None:
        """Build the token table on a daemon thread, so the first constrained request does not
        wait for it (a request that comes sooner waits on the lock)."""
        threading.Thread(target=lambda: self.ll_tokenizer, name="grammar-tokenizer",
                         daemon=True).start()

    def check(self, constraint: StructuredOutput) -> None:
        """Raise GrammarError when `constraint` does not compile (cached either way)."""
        self._pristine(constraint)

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `constraint`'s grammar."""
        return self._pristine(constraint).deep_copy()

    def _pristine(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        key = constraint.key
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {constraint.kind.value} constraint is not supported: "
                               f"{matcher.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self._compiled[key] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher


def grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (not yet checked)."""
    kind, spec = constraint.kind, constraint.spec
    if kind is StructuredKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=_JSON_OPTIONS)
    if kind is StructuredKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=_JSON_OPTIONS)
    if kind is StructuredKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    assert kind is StructuredKind.CHOICE, kind
    # Lark string literals take JSON's escapes.
    alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec))
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


@dataclass(slots=True)
class _State:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # output tokens the matcher has consumed


class GrammarMasks:
    """Per-request matchers; masks the logits rows of requests with a constraint."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._states: dict[str, _State] = {}

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set to -inf, in place, every logit the grammar forbids. `logits`: [rows, vocab]."""
        # Invariant: row i's mask depends only on requests[i]'s constraint and committed output.
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured is not None]
        if not rows:
            return
        words = (logits.shape[1] + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)  # [rows, words]
        for j, i in enumerate(rows):
            matcher = self._synced(requests[i])
            matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
        self.apply_bitmask(logits, rows, bitmask)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """Set to -inf the logits of `rows` whose bit in `bitmask` ([len(rows), words] int32,
        bit j of word w allows token 32 * w + j) is clear."""
        vocab = logits.shape[1]
        # numpy's unpackbits: one pass over the bytes, no [rows, vocab] int64 temporaries.
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1,
                                bitorder="little")[:, :vocab]  # [rows, vocab] uint8
        if logits.device.type == "cpu" and logits.is_contiguous():
            values = logits.numpy()  # shares memory
            for j, i in enumerate(rows):
                np.copyto(values[i], -np.inf, where=allowed[j] == 0)
            return
        blocked = torch.from_numpy(allowed == 0).to(logits.device)  # [rows, vocab]
        for j, i in enumerate(rows):
            logits[i].masked_fill_(blocked[j], float("-inf"))

    def _synced(self, request: Request) -> llguidance.LLMatcher:
        """The request's matcher, caught up with its committed output tokens."""
        constraint = request.sampling_params.structured
        assert constraint is not None
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _State(self.grammars.matcher(constraint))
        output = request.output_token_ids
        if state.num_consumed > len(output):
            state.matcher.rollback(state.num_consumed - len(output))
            state.num_consumed = len(output)
        if state.num_consumed < len(output):
            state.matcher.consume_tokens(output[state.num_consumed:])
            state.num_consumed = len(output)
        return state.matcher
