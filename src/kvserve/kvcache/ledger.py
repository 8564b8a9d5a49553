"""The ledger: every live request the cache serves, with the blocks it holds.

The ledger is the source of truth for "who holds what". A block's refcount must equal the number
of block tables in the ledger that list it; the audit checks exactly that.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.errors import CacheCorruption
from kvserve.kvcache.hashing import ROOT_HASH, TOKEN_WIDTH, chain_hashes, encode_tokens

_BLOCK_ID = attrgetter("block_id")
_EPOCH = attrgetter("epoch")
_REF_CNT = attrgetter("ref_cnt")


@dataclass(slots=True)
class RequestRecord:
    """One request's view of the cache.

    `block_table[i]` holds tokens `[i*block_size, (i+1)*block_size)`; `block_epochs[i]` is the
    epoch that block had when this request took it. `block_hashes[i]` (computed lazily) is the
    chained hash of the i-th full block of `token_ids`; `num_computed_tokens` tokens have their KV
    written and committed.
    """

    request_id: str
    token_ids: list[int]
    salt: str | None
    root_extra: bytes  # encoded extra keys of the first block (model, adapter, salt)
    created_at: float
    last_active: float
    adapter_digest: bytes | None = None  # the LoRA adapter it runs under (None: base model)
    block_table: list[KVBlock] = field(default_factory=list)
    block_epochs: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    block_token_bytes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # served from the prefix cache at admission
    pending_hashes: list[bytes] = field(default_factory=list)  # full blocks being computed
    # Swapped out (preempted by swapping): the private host slots, (slot id, epoch) in table
    # order, holding its computed tokens' KV until it is swapped back in.
    swap_slots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return list(map(_BLOCK_ID, self.block_table))

    def find_corruption(self, checksums: Mapping[int, int] | None = None) -> CacheCorruption | None:
        """The first block of the table reassigned (epoch changed) or released (refcount 0)
        under this request, or, with `checksums`, holding content other than the checksum
        recorded when it was written; None when every block is still its own. Read-only."""
        # Invariant: the common case (nothing wrong, no checksums) is decided by two C-level
        # passes over the table; the loop below only names the culprit.
        table = self.block_table
        if (checksums is None and list(map(_EPOCH, table)) == self.block_epochs
                and (not table or min(map(_REF_CNT, table)) > 0)):
            return None
        for block, epoch in zip(self.block_table, self.block_epochs, strict=True):
            detail = None
            if block.epoch != epoch:
                detail = "block was reassigned to other content while this request held it"
            elif block.ref_cnt <= 0:
                detail = "block was released while this request still holds it"
            elif checksums is not None and block.block_id in checksums and (
                block.checksum is not None and block.checksum != checksums[block.block_id]
            ):
                detail = (
                    f"content checksum {checksums[block.block_id]:#x} differs from the "
                    f"{block.checksum:#x} recorded when the block was written"
                )
            if detail is not None:
                return CacheCorruption(self.request_id, block.block_id, epoch, block.epoch,
                                       detail)
        return None

    def num_blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """New blocks the table needs to hold `num_tokens` tokens (0 when it holds them)."""
        return max(-(-num_tokens // block_size) - len(self.block_table), 0)

    def extend_hashes(self, num_full_blocks: int, block_size: int) -> None:
        """Extend the chained block hashes (and token bytes) to cover `num_full_blocks`."""
        hashes, token_bytes = self.block_hashes, self.block_token_bytes
        first = len(hashes)
        if first >= num_full_blocks:
            return
        # One encoding for all new blocks, sliced per block: far cheaper than one per block.
        bs = block_size
        new_hashes, new_bytes = chain_hashes(
            hashes[-1] if hashes else ROOT_HASH,
            encode_tokens(self.token_ids[first * bs : num_full_blocks * bs]),
            bs * TOKEN_WIDTH,
            None if hashes else self.root_extra,
        )
        hashes.extend(new_hashes)
        token_bytes.extend(new_bytes)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """A read-only summary of one live request, for /debug/kv and the doctor."""

    request_id: str
    num_blocks: int
    block_ids: tuple[int, ...]
    num_tokens: int
    num_computed_tokens: int
    age_s: float
    idle_s: float


class Ledger:
    """Live request records by id. Insertion order is admission order (oldest first)."""

    def __init__(self) -> None:
        self._records: dict[str, RequestRecord] = {}

    def add(self, record: RequestRecord) -> None:
        if record.request_id in self._records:
            raise ValueError(
                f"request {record.request_id!r} is already in the cache; free it first or use a "
                "unique request id"
            )
        self._records[record.request_id] = record

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def pop(self, request_id: str) -> RequestRecord | None:
        return self._records.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def abandoned(
        self, now: float, idle_timeout_s: float | None, live_request_ids: Collection[str] | None
    ) -> list[RequestRecord]:
        """Records nobody will free: not in `live_request_ids` (when given), or holding blocks
        idle for longer than `idle_timeout_s` (when given). Oldest first."""
        live = None if live_request_ids is None else set(live_request_ids)
        return [
            r for r in self._records.values()
            if (live is not None and r.request_id not in live)
            or (idle_timeout_s is not None and r.block_table
                and now - r.last_active > idle_timeout_s)
        ]

    def summary(self, now: float) -> list[LedgerEntry]:
        """Every live request, oldest first."""
        return [
            LedgerEntry(
                request_id=r.request_id,
                num_blocks=len(r.block_table),
                block_ids=tuple(r.block_ids),
                num_tokens=len(r.token_ids),
                num_computed_tokens=r.num_computed_tokens,
                age_s=now - r.created_at,
                idle_s=now - r.last_active,
            )
            for r in self._records.values()
        ]
