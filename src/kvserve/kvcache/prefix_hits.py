"""Prefix hits across the tiers: finding the longest cached head, and claiming it safely.

A hit is the request's full prompt blocks found, in order, in the device pool's hash map, then
block by block in the host tier's READY slots or, where the host misses, the disk tier's (the
host evicts a chain's deepest blocks first, so a chain often continues across both tiers): a
contiguous head either way. Finding is read-only; claiming re-checks that every block and
slot still holds the very content, at the very epoch, the lookup saw.

Blocks in flight: when the scheduler plans a step, a request admitted in it may share the full
prompt blocks another request of the same step writes (a burst of prompts with one system prompt,
n samples of one prompt). Within one forward pass every layer writes the whole step's K/V before
any token attends, so those blocks hold their KV by the time the joiner reads them. Only blocks
wholly written by the step are shared, only after a device-only head, and never published by the
joiner: the writer publishes them when the step is committed.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.kvcache.block import KVBlock
from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.host_tier import HostSlot, SlotState
from kvserve.kvcache.ledger import Ledger, RequestRecord
from kvserve.kvcache.transfers import LoadSource, TransferLedger
from kvserve.kvcache.types import PrefixHit

TierSlots = list[tuple[HostSlot, LoadSource]]


def find_prefix_hit(pool: BlockPool, tiers: TransferLedger | None, pending: Mapping[bytes, str],
                    record: RequestRecord, in_flight: Mapping[str, int] | None = None,
                    ledger: Ledger | None = None) -> PrefixHit:
    """The longest cached head of the request's prompt, capped so that at least one token is
    left to compute, and how many tokens right after it other live requests are computing.
    With `in_flight` (request id -> tokens whose KV it will have written when the step being
    planned ends) and the `ledger`, a device-only head continues through the blocks those
    requests announced and write in that step. Read-only, except that a refused hash collision
    is counted."""
    bs = pool.block_size
    max_blocks = (len(record.token_ids) - 1) // bs
    record.extend_hashes(max_blocks, bs)
    hit: list[KVBlock] = []
    for idx in range(max_blocks):
        block = pool.get_cached_block(record.block_hashes[idx], record.block_token_bytes[idx])
        if block is None:
            break
        hit.append(block)
    host_hit: list[HostSlot] = []
    disk_hit: list[HostSlot] = []
    from_disk: list[bool] = []
    if tiers is not None:
        for idx in range(len(hit), max_blocks):
            found = tiers.find_hit(record, idx, idx + 1, pending)
            if not found and tiers.disk is not None:
                found = tiers.find_hit(record, idx, idx + 1, pending, tiers.disk)
                disk_hit += found
            else:
                host_hit += found
            if not found:
                break
            from_disk.append(found[0] in disk_hit)
    owners: list[str] = []
    num_cached = len(hit)
    if in_flight and ledger is not None and not host_hit and not disk_hit:
        owners = _extend_in_flight(hit, record, pending, in_flight, ledger, max_blocks, bs)
    num_hit = len(hit) + len(host_hit) + len(disk_hit)
    num_pending = 0
    for idx in range(num_hit, max_blocks):
        if pending.get(record.block_hashes[idx]) in (None, record.request_id):
            break
        num_pending += 1
    return PrefixHit(
        block_ids=tuple(b.block_id for b in hit),
        epochs=tuple(b.epoch for b in hit),
        num_tokens=num_hit * bs,
        num_pending_tokens=num_pending * bs,
        host_slots=tuple(s.slot_id for s in host_hit),
        host_epochs=tuple(s.epoch for s in host_hit),
        disk_slots=tuple(s.slot_id for s in disk_hit),
        disk_epochs=tuple(s.epoch for s in disk_hit),
        from_disk=tuple(from_disk) if disk_hit else (),
        num_in_flight_tokens=(len(hit) - num_cached) * bs,
        in_flight_owners=tuple(dict.fromkeys(owners)),
    )


def _extend_in_flight(hit: list[KVBlock], record: RequestRecord, pending: Mapping[bytes, str],
                      in_flight: Mapping[str, int], ledger: Ledger, max_blocks: int,
                      bs: int) -> list[str]:
    """Append to `hit` the announced blocks its writers fill in the step being planned; returns
    the writer of each appended block."""
    owners = []
    for idx in range(len(hit), max_blocks):
        block_hash = record.block_hashes[idx]
        owner = pending.get(block_hash)
        # Only a block the writer's chunk of this step covers whole (the request looking up is
        # never in `in_flight`: it is not planned yet).
        if owner is None or (idx + 1) * bs > in_flight.get(owner, 0):
            break
        writer = ledger.get(owner)
        if (writer is None or idx >= len(writer.block_table)
                or writer.block_hashes[idx] != block_hash):
            break
        hit.append(writer.block_table[idx])
        owners.append(owner)
    return owners


def claim_prefix_hit(pool: BlockPool, tiers: TransferLedger | None, record: RequestRecord,
                     hit: PrefixHit) -> tuple[list[KVBlock], TierSlots]:
    """The hit's device blocks and tier slots (with the tier each is loaded from), once proven
    to be the content this request hashed at the epochs the lookup saw. Raises ValueError for
    a stale hit (call lookup again) or one in a tier this cache does not have. Read-only."""
    blocks = [pool.blocks[i] for i in hit.block_ids]
    if (hit.host_slots or hit.disk_slots) and (
            tiers is None or (hit.disk_slots and tiers.disk is None)):
        raise ValueError(f"request {record.request_id!r}: a prefix hit in a tier this cache "
                         "does not have")
    slots: TierSlots = []
    epochs = list(hit.epochs)
    if tiers is not None:
        host = iter(zip(hit.host_slots, hit.host_epochs, strict=True))
        disk = iter(zip(hit.disk_slots, hit.disk_epochs, strict=True))
        num_slots = len(hit.host_slots) + len(hit.disk_slots)
        for is_disk in hit.from_disk or (False,) * num_slots:
            slot_id, epoch = next(disk if is_disk else host)
            pool_of = tiers.disk if is_disk and tiers.disk is not None else tiers.host
            slots.append((pool_of.slots[slot_id], LoadSource.DISK if is_disk else LoadSource.HOST))
            epochs.append(epoch)
    record.extend_hashes(len(blocks) + len(slots), pool.block_size)
    expected = record.block_hashes[: len(blocks) + len(slots)]
    # In flight: still being written, so not yet published (and held by their writers).
    num_cached = len(blocks) - hit.num_in_flight_tokens // pool.block_size
    if [b.epoch for b in blocks] + [s.epoch for s, _ in slots] != epochs or any(
        b.block_hash != h for b, h in zip(blocks[:num_cached], expected, strict=False)
    ) or any(b.block_hash is not None or b.ref_cnt == 0 for b in blocks[num_cached:]) or any(
        s.state is not SlotState.READY or s.block_hash != h
        for (s, _), h in zip(slots, expected[len(blocks) :], strict=True)
    ):
        raise ValueError(f"request {record.request_id!r}: stale prefix hit; call lookup again")
    return blocks, slots
