"""Deterministic text prompts of an exact token length for `kvserve bench serve`.

Prompts are text, not token ids (SGLang's router rejects id prompts), built from whole-word
entries of the model's own vocabulary (" serving", " cache", ...) so that the server's tokenizer
turns them back into the intended number of tokens. Same tokenizer, seed and sizes: same text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package imports torch; a prompt builder only needs the tokenizer's API
    from kvserve.model import Tokenizer

MIN_WORDS = 8  # fewer whole-word tokens than this: the vocabulary is not word-level enough
MAX_FIXUPS = 64  # re-encodings spent nudging one prompt to its exact length


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """Sizes of one batch of prompts. `prefix_fraction` of each prompt's tokens (rounded down)
    is a prefix shared by every prompt of the batch; the rest is unique per prompt."""

    num_prompts: int
    input_len: int
    prefix_fraction: float = 0.0

    @property
    def prefix_len(self) -> int:
        return int(self.input_len * self.prefix_fraction)

    def check(self) -> None:
        """Raise ValueError naming the first size out of range."""
        if self.num_prompts < 1 or self.input_len < 2:
            raise ValueError("--num-prompts must be >= 1 and --input-len >= 2")
        if not 0.0 <= self.prefix_fraction < 1.0:
            raise ValueError(f"--prefix-fraction must be in [0, 1), got {self.prefix_fraction}")


class PromptBuilder:
    """Builds text prompts whose encoding (special tokens included, as a server encodes a
    completion prompt) is `input_len` tokens long; it says how far off it is when it cannot."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_special = len(tokenizer.encode(""))  # BOS, when the tokenizer adds one
        self.words = self._single_token_words()
        if len(self.words) < MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(self.words)} whole-word tokens; "
                             "text prompts of an exact length need a word-level vocabulary")

    def _single_token_words(self) -> tuple[str, ...]:
        words = []
        for token_id in range(self.tokenizer.vocab_size):
            text = self.tokenizer.decode([token_id])
            word = text[1:]
            if (text.startswith(" ") and word.isascii() and word.isalpha()
                    and self.tokenizer.encode(text, add_special_tokens=False) == [token_id]):
                words.append(text)
        return tuple(words)

    def num_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _words(self, rng: random.Random, n: int) -> list[str]:
        return [rng.choice(self.words) for _ in range(n)]

    def build(self, spec: PromptSpec, seed: str) -> list[str]:
        """`spec.num_prompts` prompts drawn from `seed` (any string; distinct seeds give
        unrelated prompts, including their shared prefix)."""
        rng = random.Random(f"serve-prompts/{seed}")
        prefix = "".join(self._words(rng, spec.prefix_len))
        prompts = []
        for _ in range(spec.num_prompts):
            suffix_len = spec.input_len - spec.prefix_len - self.num_special
            prompts.append(self._exact(prefix, self._words(rng, max(suffix_len, 1)),
                                       spec.input_len, rng))
        return prompts

    def _exact(self, prefix: str, words: list[str], target: int, rng: random.Random) -> str:
        # Whole-word tokens of a word-level BPE never merge across words, so this loop rarely
        # runs; it exists for tokenizers where they do.
        for _ in range(MAX_FIXUPS):
            n = self.num_tokens(prefix + "".join(words))
            if n == target:
                break
            if n > target and len(words) > 1:
                words.pop()
            elif n < target:
                words.extend(self._words(rng, 1))
            else:
                break
        return prefix + "".join(words)


def prompt_lengths(builder: PromptBuilder, prompts: Sequence[str]) -> list[int]:
    """Token counts of `prompts` as a server would encode them (special tokens included)."""
    return [builder.num_tokens(p) for p in prompts]
