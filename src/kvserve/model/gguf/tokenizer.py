"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds, as llama.cpp names them in ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE with the file's merges, split first by the regex that
  ``tokenizer.ggml.pre`` names (the regex the merges were learned on). Known names are in
  ``PRE_TOKENIZER_SPLITS``; any other is refused with a way out (``--tokenizer``), since a wrong
  split silently changes every token id.
- ``llama``: SentencePiece-style BPE over ``▁``-marked pieces with byte fallback (``<0xNN>``);
  the file gives scores, not merges, so merges are derived from them (a higher-scored piece
  merges first), as transformers does.

Control tokens (token type 3) become special added tokens and user-defined ones (type 4) plain
added tokens, so text like ``<|im_start|>`` stays one token. BOS/EOS are added per
``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (llama vocabularies add BOS when unstated).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from kvserve.model.errors import ModelLoadError
from kvserve.model.gguf.reader import GGUFFile

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
# tokenizer.ggml.pre -> the regexes applied in turn (each piece of one split is split by the next).
# "default" is byte-level GPT-2, as transformers reads it.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": _DIGITS_THEN_GPT2,  # SmolLM's own tokenizer splits every digit
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "megrez": (_QWEN2_SPLIT,),
}


def build_tokenizer(gguf_file: GGUFFile) -> HFTokenizer:
    """The file's tokenizer; ModelLoadError naming the key when the metadata cannot make one."""
    meta = gguf_file.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{gguf_file.path}: no 'tokenizer.ggml.tokens' in its metadata; "
                             "pass a tokenizer with --tokenizer DIR (a tokenizer.json)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level(gguf_file, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tokenizer = _sentencepiece(gguf_file, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(f"{gguf_file.path}: tokenizer.ggml.model is {kind!r}; kvserve "
                             "builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) "
                             "tokenizers; pass one with --tokenizer DIR")
    vocab = tokenizer.get_vocab()
    special = _special_ids(meta, types)
    # Only tokens the vocabulary spells as stored (a byte-level file may store a few in plain
    # UTF-8; adding those would grow the vocabulary past the model's).
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                  for i in sorted(special) if vocab.get(tokens[i]) == i])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for i, (t, kind_) in enumerate(zip(tokens, types, strict=False))
                          if kind_ == _USER_DEFINED and i not in special and vocab.get(t) == i])
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _post_processor(meta, tokens, add_bos, add_eos)
    return tokenizer


def special_token(gguf_file: GGUFFile, role: str) -> str | None:
    """The text of the ``bos``/``eos``/``eot``/``unknown``/``padding`` token, if the file names
    one."""
    tokens = gguf_file.metadata.get("tokenizer.ggml.tokens") or []
    index = gguf_file.metadata.get(f"tokenizer.ggml.{role}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _special_ids(meta: dict[str, Any], types: list[int]) -> set[int]:
    """Control and unknown tokens, and whatever the file names bos/eos/eot/unknown/padding."""
    ids = {i for i, kind in enumerate(types) if kind in (_CONTROL, _UNKNOWN)}
    for role in ("bos", "eos", "eot", "unknown", "padding"):
        index = meta.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(index, int):
            ids.add(index)
    return ids


def _byte_level(gguf_file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    pre = gguf_file.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"{gguf_file.path}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer kvserve does not "
            f"know (known: {', '.join(PRE_TOKENIZER_SPLITS)}); splitting text another way would "
            "change the token ids silently. Pass the original model's tokenizer with "
            "--tokenizer DIR (a directory with tokenizer.json)")
    merges = gguf_file.metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ModelLoadError(f"{gguf_file.path}: a gpt2 tokenizer needs "
                             "'tokenizer.ggml.merges', which is missing")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {_byte_spelling(t, alphabet): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = HFTokenizer(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_spelling(token: str, alphabet: set[str]) -> str:
    """The token in the byte-level alphabet (a file may store a few in plain UTF-8)."""
    if set(token) <= alphabet:
        return token
    table = _byte_table()
    return "".join(table[b] for b in token.encode("utf-8"))


def _byte_table() -> list[str]:
    """GPT-2's byte -> printable character map: printable Latin-1 maps to itself, the other
    bytes to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = [], 0
    for byte in range(256):
        if byte in keep:
            table.append(chr(byte))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def _sentencepiece(gguf_file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores = gguf_file.metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelLoadError(f"{gguf_file.path}: a llama (SentencePiece) tokenizer needs one "
                             "'tokenizer.ggml.scores' entry per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = special_token(gguf_file, "unknown")
    merges = merges_from_scores(tokens, scores)
    tokenizer = HFTokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(gguf_file.metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens, the
    best-scored result first; ties go to the longer left, then the longer right piece, then to
    vocabulary order (token, then the pieces' ids)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [(ids[token[:k]], ids[token[k:]], token[:k], token[k:])
                 for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        local.sort()
        found.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    found.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: equal keys keep their order
    return [(left, right) for _, _, _, left, right in found]


def _post_processor(meta: dict[str, Any], tokens: list[str], add_bos: bool,
                    add_eos: bool) -> processors.TemplateProcessing:
    single, specials = ["$A"], []
    for role, wanted, at_start in (("bos", add_bos, True), ("eos", add_eos, False)):
        index = meta.get(f"tokenizer.ggml.{role}_token_id")
        if wanted and isinstance(index, int):
            single = [tokens[index], *single] if at_start else [*single, tokens[index]]
            specials.append((tokens[index], index))
    pair = [*single, *[s if s != "$A" else "$B" for s in single]]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
