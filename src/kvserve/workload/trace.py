"""Trace requests and the readers for the public traces (Mooncake, Azure 2023; docs/traces.md).

A `TraceRequest` describes a prompt by its *content blocks*: `hash_ids[i]` names the content of
tokens `[i * TRACE_BLOCK_SIZE, (i + 1) * TRACE_BLOCK_SIZE)`, and, as in the Mooncake traces, an id
already encodes the whole prefix up to and including its block. Two requests share a prefix of k
blocks exactly when their first k ids are equal. `prompt_token_ids` turns that into concrete token
ids, so a KV cache that hashes real tokens sees the same sharing the trace recorded.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE_BLOCK_SIZE = 512
"""Tokens per `hash_ids` entry (the Mooncake traces use 512-token blocks)."""


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload.

    `hash_ids` may be empty (traces without prefix information): the prompt is then unique.
    The last block may be partial: `input_length` is authoritative for the prompt's length.
    """

    request_id: str
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    tenant: str | None = None


def prompt_token_ids(request: TraceRequest, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """Concrete token ids for `request`'s prompt, `input_length` long.

    Block i's tokens are a pure function of `hash_ids[i]`, distinct from every other id's tokens,
    so equal id prefixes give equal token prefixes and nothing else does. Positions past the last
    id (a trace without prefix data) get tokens unique to the request.
    """
    tokens: list[int] = []
    for block_idx, content_id in enumerate(request.hash_ids):
        start = content_id * block_size
        take = min(block_size, request.input_length - block_idx * block_size)
        if take <= 0:
            break
        tokens.extend(range(start, start + take))
    if len(tokens) < request.input_length:
        # Unique filler: negative ids cannot collide with the (non-negative) content ids above.
        digest = hashlib.blake2b(request.request_id.encode(), digest_size=5).digest()
        base = -int.from_bytes(digest, "big") * block_size - 1
        tokens.extend(range(base, base - (request.input_length - len(tokens)), -1))
    return tokens


def load_mooncake_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace: `{timestamp, input_length, output_length, hash_ids}` a line."""
    path = Path(path)
    requests: list[TraceRequest] = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                request = TraceRequest(
                    request_id=f"{path.stem}-{line_no}",
                    arrival_ms=float(row["timestamp"]),
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceFormatError(
                    f"{path}:{line_no}: not a Mooncake trace line ({exc!r}); expected JSON with "
                    "timestamp, input_length, output_length and hash_ids"
                ) from exc
            if request.input_length <= 0:
                raise TraceFormatError(f"{path}:{line_no}: input_length must be positive")
            requests.append(request)
    return requests


def load_azure_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    The trace has no prefix information, so every prompt is unique.
    """
    path = Path(path)
    requests: list[TraceRequest] = []
    start: datetime | None = None
    with path.open(newline="") as f:
        for line_no, row in enumerate(csv.DictReader(f), start=2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                # Timestamps carry 7 fractional digits; datetime takes at most 6.
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceFormatError(
                    f"{path}:{line_no}: not an Azure trace row ({exc!r}); expected "
                    "TIMESTAMP,ContextTokens,GeneratedTokens"
                ) from exc
            start = start or stamp
            requests.append(
                TraceRequest(
                    request_id=f"{path.stem}-{line_no}",
                    arrival_ms=(stamp - start).total_seconds() * 1000.0,
                    input_length=max(1, context),
                    output_length=generated,
                )
            )
    return requests


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace by its file type: `.jsonl` is Mooncake's format, `.csv` Azure's."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such trace file")
    if path.suffix == ".jsonl":
        return load_mooncake_trace(path, limit)
    if path.suffix == ".csv":
        return load_azure_trace(path, limit)
    raise TraceFormatError(
        f"{path}: unknown trace type {path.suffix!r}; use a Mooncake .jsonl or an Azure 2023 .csv"
    )


def write_mooncake_trace(requests: list[TraceRequest], path: str | Path) -> None:
    """Write `requests` in Mooncake's JSONL format (readable by `load_mooncake_trace`)."""
    with Path(path).open("w") as f:
        for r in requests:
            row = {"timestamp": r.arrival_ms, "input_length": r.input_length,
                   "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            f.write(json.dumps(row) + "\n")
