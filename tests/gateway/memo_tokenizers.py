"""Tokenizers of the families a gateway meets, built in-process (nothing downloaded), for the
tokenizer memo's tests: the demo byte-level BPE (the fixtures' 300-token one and the demo model's),
GPT-2-style byte-level BPE (prefix space, trimmed offsets), a Llama-3/Qwen2-style regex split
with 3-digit groups, sentencepiece-style Unigram behind Metaspace ("first" and "always"),
Llama-2-style BPE with a Prepend normalizer and no pre-tokenizer, BERT WordPiece (a trailing
[SEP]), and a hand-made BPE whose tokens never resynchronize inside a run of "a"s."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from kvserve.model.demo_tokenizer import build_tokenizer

CORPUS = """\
The gateway routes each request to the worker that already holds its prefix in the KV cache.
A block holds 16 tokens; 2048 tokens make 128 blocks, and 3072 tokens make 192 of them.
def route(request):\n    key = hash(request.prefix)\n    return workers[key % 4]\n
Tenants send long system prompts, then short questions: "What changed in Q3 2024?"
Numbers like 1234567, 3.14159 and 1,000,000 appear in financial filings and logs.
Unicode: naïve café, Zürich, 東京, São Paulo, emoji 🙂 and e\u0301 (a combining accent).
Whitespace:    runs of spaces,\ttabs\t\tand\n\nblank lines matter to byte-level tokenizers.
<|im_start|>system\nYou are a careful auditor.<|im_end|>\n<|im_start|>user\nCheck it.<|im_end|>
It's the cache's job; they're fast, we'll see, you'd think so, I'm sure, they've won.
"""
LINES = [line for line in CORPUS.splitlines() if line] * 4
CHAT_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# Llama-3/Qwen2-like: contractions, letter runs with a leading space, digits in groups of up to
# three, punctuation runs, newline runs, and whitespace runs that leave their last space to the
# next word (the lookahead).
SPLIT_PATTERN = (r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _bos(tokenizer: Tokenizer, bos: str = "<s>") -> None:
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])


def demo_fixture() -> Tokenizer:
    """The tokenizer every tiny test checkpoint gets (vocab_size 300)."""
    return build_tokenizer(300)


def demo_model() -> Tokenizer:
    """The demo model's tokenizer, which `kvserve bench gateway` workers use."""
    return build_tokenizer(1 << 16)


def gpt2_style() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=700, special_tokens=CHAT_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def llama3_style() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=700, special_tokens=CHAT_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    _bos(tok)
    return tok


def _unigram(prepend_scheme: str) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme, split=True)
    tok.train_from_iterator(LINES, trainers.UnigramTrainer(
        vocab_size=400, special_tokens=["<unk>", *CHAT_SPECIALS], unk_token="<unk>",
        show_progress=False))
    _bos(tok)
    return tok


def metaspace_first() -> Tokenizer:
    return _unigram("first")


def metaspace_always() -> Tokenizer:
    return _unigram("always")


def llama2_style() -> Tokenizer:
    """Sentencepiece converted to BPE: "▁" prepended and spaces replaced by the normalizer, no
    pre-tokenizer, so the whole text is one word and merges may span spaces."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *CHAT_SPECIALS], show_progress=False,
        initial_alphabet=sorted(set(CORPUS.replace(" ", "▁")))))
    _bos(tok)
    return tok


def bert_style() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[UNK]", "[CLS]", "[SEP]", *CHAT_SPECIALS],
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return tok


def never_resyncs() -> Tokenizer:
    """Prepend "▁", then BPE merges "▁a" before "aa": a run of "a"s pairs up from the text's
    start, but a tail starting inside the run pairs up one "a" off, to the run's end."""
    vocab = {"<s>": 0, "▁": 1, "a": 2, "b": 3, "c": 4, "▁a": 5, "aa": 6}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "a")]))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    _bos(tok)
    return tok


FAMILIES: dict[str, Callable[[], Tokenizer]] = {
    "demo_fixture": demo_fixture, "demo_model": demo_model, "gpt2_style": gpt2_style,
    "llama3_style": llama3_style, "metaspace_first": metaspace_first,
    "metaspace_always": metaspace_always, "llama2_style": llama2_style,
    "bert_style": bert_style,
}
