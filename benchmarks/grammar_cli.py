"""`python -m benchmarks grammar`: the per-token cost of a structured-output token mask.

For one JSON schema and a valid document of it, tokenized with the given tokenizer, each
backend walks the document token by token: compute the mask of allowed tokens, apply it to a
row of logits, consume the token. Reports the grammar's compile time and the per-token mask
and apply times (median and p90, microseconds). llguidance is kvserve's backend; xgrammar is
measured when importable (it is not a kvserve dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"},
            "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "email", "tier"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "gift": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "gift", "note"],
    "additionalProperties": False,
}
DOCUMENT: dict[str, Any] = {
    "order_id": 48213,
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [{"sku": "KVC-0042", "qty": 2, "price": 19.99},
              {"sku": "GPU-1337", "qty": 1, "price": 2499.0},
              {"sku": "RAM-0064", "qty": 4, "price": 129.5}],
    "gift": False,
    "note": "Please deliver to the loading dock behind the building before noon.",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("grammar", help="per-token cost of structured-output masks")
    p.add_argument("--tokenizer", required=True, action="append",
                   help="a tokenizer.json (repeat to compare vocabularies)")
    p.add_argument("--repeats", type=int, default=20, help="walks of the document per backend")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = []
    for path in args.tokenizer:
        for backend in (_llguidance, _xgrammar):
            row = backend(Path(path), args.repeats)
            if row is not None:
                rows.append(row)
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['backend']:<11} vocab {row['vocab']:>7}  compile {row['compile_ms']:8.2f} "
                  f"ms  mask p50 {row['mask_us_p50']:8.1f} us  p90 {row['mask_us_p90']:8.1f} us  "
                  f"apply p50 {row['apply_us_p50']:7.1f} us  ({row['tokens']} tokens)")
    return 0


def _document_text() -> str:
    return json.dumps(DOCUMENT, separators=(", ", ": "))


def _walk(tokens: list[int], repeats: int, fresh: Callable[[], Any],
          mask: Callable[[Any], None], apply: Callable[[], None],
          consume: Callable[[Any, int], None]) -> tuple[list[float], list[float]]:
    mask_s, apply_s = [], []
    for _ in range(repeats):
        matcher = fresh()
        for token in tokens:
            t0 = time.perf_counter()
            mask(matcher)
            t1 = time.perf_counter()
            apply()
            t2 = time.perf_counter()
            consume(matcher, token)
            mask_s.append(t1 - t0)
            apply_s.append(t2 - t1)
    return mask_s, apply_s


def _row(backend: str, vocab: int, compile_s: float, tokens: list[int],
         mask_s: list[float], apply_s: list[float]) -> dict[str, Any]:
    def q(values: list[float], p: float) -> float:
        return sorted(values)[int(p * (len(values) - 1))] * 1e6

    return {"backend": backend, "vocab": vocab, "compile_ms": compile_s * 1e3,
            "tokens": len(tokens), "mask_us_p50": statistics.median(mask_s) * 1e6,
            "mask_us_p90": q(mask_s, 0.9), "apply_us_p50": statistics.median(apply_s) * 1e6}


def _llguidance(path: Path, repeats: int) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer as HFTokenizer

    from kvserve.engine import StructuredOutput
    from kvserve.model.grammar import GrammarMasks, Grammars
    from kvserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(HFTokenizer.from_file(str(path)))
    vocab = tokenizer.vocab_size
    grammars = Grammars(tokenizer, vocab, [0])
    assert grammars.ll_tokenizer is not None  # the token table: built once per tokenizer
    constraint = StructuredOutput.json_schema(SCHEMA)
    t0 = time.perf_counter()
    grammars.check(constraint)
    compile_s = time.perf_counter() - t0
    tokens = tokenizer.encode(_document_text(), add_special_tokens=False)
    masks = GrammarMasks(grammars)
    logits = torch.zeros(1, vocab)  # [1, vocab]
    words = (vocab + 31) // 32
    bitmask = torch.empty(1, words, dtype=torch.int32)

    def mask(m: Any) -> None:
        m.unsafe_compute_mask_ptr(bitmask[0].data_ptr(), words * 4)

    def apply() -> None:
        masks.apply_bitmask(logits, [0], bitmask)

    def consume(m: Any, token: int) -> None:
        assert m.consume_token(token), "the document does not match the schema"

    mask_s, apply_s = _walk(tokens, repeats, lambda: grammars.matcher(constraint), mask, apply,
                            consume)
    return _row("llguidance", vocab, compile_s, tokens, mask_s, apply_s)


def _xgrammar(path: Path, repeats: int) -> dict[str, Any] | None:
    try:
        import xgrammar  # type: ignore[import-not-found]
    except ImportError:
        return None
    import torch
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))  # type: ignore[no-untyped-call]
    vocab = len(hf)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[0])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                            separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    tokens = hf.encode(_document_text(), add_special_tokens=False)
    logits = torch.zeros(1, vocab)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def consume(m: Any, token: int) -> None:
        assert m.accept_token(token), "the document does not match the schema"

    mask_s, apply_s = _walk(
        tokens, repeats, lambda: xgrammar.GrammarMatcher(compiled),
        lambda m: m.fill_next_token_bitmask(bitmask),
        lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask), consume)
    return _row("xgrammar", vocab, compile_s, tokens, mask_s, apply_s)
