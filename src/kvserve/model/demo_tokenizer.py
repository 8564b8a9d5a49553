"""A small, deterministic byte-level BPE tokenizer for demo models and test checkpoints.

Byte-level means every string round-trips (any byte has a token). Merges are learned greedily
from a fixed built-in corpus with deterministic tie-breaking, so the same ``max_vocab_size``
always yields the same ``tokenizer.json``. Built with the ``tokenizers`` library only.
"""

from __future__ import annotations

import itertools
from collections import Counter

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)  # ids 0..3, in this order
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# ChatML-style, with an optional tools preamble; renders with HF's jinja settings.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou can call these tools: {{ tools | tojson }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
A serving engine keeps the keys and values of every token it has seen, so that the next token
costs one step instead of a whole new pass over the prompt. The cache is cut into blocks of equal
size. Each request holds a table of blocks, and each block remembers which tokens it stores. When
two requests share a prefix, they can share the blocks that hold it, and the second request starts
from where the first one left off. That is why the same system prompt, sent again and again by
the same tenant, becomes cheap: the work was done once and the blocks are still there.
Blocks that nobody holds are kept in a queue, oldest first. They can still be hit by a new request
until memory runs short; then the oldest one is evicted and handed to new content. A block that a
running request still reads must never be evicted, and the books must balance at every moment:
free plus cached plus held equals the number of blocks in the pool.
Long prompts are split into chunks, so that one tenant with thirty thousand tokens does not stall
everybody else. Short questions and long documents share the same step, and the scheduler spends
one token budget across them. When the pool is full, the newest request is preempted and its
blocks are returned; it will be computed again later, from the cache where it can.
The gateway in front of the workers sends requests with the same prefix to the same worker, so
that the cache on that worker stays warm. It agrees with every other gateway replica without
talking to them, because each one hashes the prefix the same way. When a worker is saturated it
says so with a clear answer and a time to retry, and clients back off instead of piling on.
What do you want to know? Tell me about the weather today, please. Here is the answer: it is
sunny and warm, with a light wind from the west. Thank you! You are welcome. 0 1 2 3 4 5 6 7 8 9
"""


def build_tokenizer(max_vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with at most ``max_vocab_size`` tokens (deterministic).

    Ids 0..3 are ``<s> </s> <|im_start|> <|im_end|>``, then the 256 byte symbols, then merges.
    Encoding prepends ``<s>`` when special tokens are requested. Raises ValueError below
    ``MIN_VOCAB_SIZE`` (260).
    """
    if max_vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {MIN_VOCAB_SIZE}, "
                         f"got {max_vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges = _learn_merges(max_vocab_size - len(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return tokenizer


def _learn_merges(max_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE over the corpus: merge the most frequent pair (ties: smallest pair) each round."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word_counts = Counter(word for word, _ in pre.pre_tokenize_str(_CORPUS))
    words = {tuple(word): count for word, count in sorted(word_counts.items())}
    merges: list[tuple[str, str]] = []
    known: set[str] = set()
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        words = {_merge(symbols, best, merged): count for symbols, count in words.items()}
        if merged in known:  # two different splits of one string: keep the first merge only
            continue
        known.add(merged)
        merges.append(best)
    return merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)
