"""Key sets of OpenAI response bodies, per kind of object, to compare kvserve's answers with
vLLM's recorded ones (tests/data/vllm_responses): the same requests must give objects with the
same keys, vLLM's nulls included, whatever the values.

An object's kind is its path from the body (`choices[].message`, `usage`, ...); a stream's
chunks are told apart by what they carry (the role chunk, content, tool-call pieces, the
finish chunk, the usage chunk), and tool-call items by whether they open a call (`id`) or
continue one. Only kinds both answers have are compared: where one answer has an object and the
other a null (a value vLLM leaves out), the enclosing object's keys still match.
"""

from __future__ import annotations

from typing import Any

# Lists of maps (token text or token id -> logprob): their keys are data, not fields; the
# values' keys are compared instead.
MAP_LISTS = (".choices[].logprobs.top_logprobs", ".choices[].prompt_logprobs",
             "$.prompt_logprobs")
# kvserve-only keys, each with its reason; nothing else may differ.
EXTRA = {"usage": {"prompt_tokens_details"}}  # cached_tokens, as vLLM's
# --enable-prompt-tokens-details sends them (its streamed usage has none without it)


def chunk_kind(chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    if "role" in choice.get("delta", {}):
        return "role"
    if choice["finish_reason"] is not None:
        return "finish"
    return "tool" if choice.get("delta", {}).get("tool_calls") else "content"


def key_sets(value: Any, path: str, out: dict[str, set[frozenset[str]]]) -> None:
    """Add the key set of every object in `value` to `out[its path]`."""
    if isinstance(value, dict):
        out.setdefault(path, set()).add(frozenset(value))
        for key, item in value.items():
            key_sets(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            if path.endswith(MAP_LISTS) and isinstance(item, dict):
                for entry in item.values():
                    key_sets(entry, f"{path}[{{}}]", out)
                continue
            kind = ""
            if path.endswith(".tool_calls") and isinstance(item, dict):
                kind = "head" if "id" in item else "pieces"
            key_sets(item, f"{path}[{kind}]", out)


def body_key_sets(body: dict[str, Any]) -> dict[str, set[frozenset[str]]]:
    out: dict[str, set[frozenset[str]]] = {}
    key_sets(body, "$", out)
    return out


def stream_key_sets(chunks: list[dict[str, Any]]) -> dict[str, set[frozenset[str]]]:
    """Per chunk kind; a finish chunk's delta is left out (what it holds depends on the
    sample: the last text, the last argument piece, or nothing)."""
    out: dict[str, set[frozenset[str]]] = {}
    for chunk in chunks:
        kind = chunk_kind(chunk)
        if kind == "finish":
            chunk = chunk | {"choices": [{k: v for k, v in c.items() if k != "delta"}
                                         for c in chunk["choices"]]}
        key_sets(chunk, f"{kind}:$", out)
    return out


def assert_same_key_sets(ours: dict[str, set[frozenset[str]]],
                         theirs: dict[str, set[frozenset[str]]], what: str) -> int:
    """Every kind both have: the same key sets (less `EXTRA`). Returns the kinds compared."""
    common = sorted(set(ours) & set(theirs))
    for path in common:
        extra = EXTRA.get(path.rsplit(".", 1)[-1], set())
        mine = {keys - (extra - union) for keys in ours[path]
                for union in [frozenset().union(*theirs[path])]}
        assert mine == theirs[path], (
            f"{what} {path}: kvserve sends keys {[sorted(k) for k in mine]}, "
            f"vLLM {[sorted(k) for k in theirs[path]]}")
    return len(common)
