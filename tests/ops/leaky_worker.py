"""TEST-ONLY: `kvserve serve` with a planted block leak (the fault the doctor must name).

Run as `python -m tests.ops.leaky_worker <serve args>`. Two patches, applied before the engine
is built: `KVCacheManager.free` skips aborted requests (a client that disconnects mid-stream
leaves its blocks behind), and `KVCacheManager.reap` reclaims nothing (so the idle check's
reaper cannot hide the leak). With `--tensor-parallel-size N` the leak is the group's: rank 0,
this process, owns the one KV-cache manager. Never imported by kvserve itself.
"""

from __future__ import annotations

import sys

from kvserve.kvcache import FreeReason
from kvserve.kvcache.manager import KVCacheManager

_free = KVCacheManager.free


def _leaky_free(self: KVCacheManager, request_id: str,
                reason: FreeReason = FreeReason.FINISHED) -> int:
    if reason is FreeReason.ABORTED:
        return 0
    return _free(self, request_id, reason)


def _no_reap(self: KVCacheManager, *args: object, **kwargs: object) -> list[str]:
    return []


def main() -> int:
    KVCacheManager.free = _leaky_free  # type: ignore[method-assign]
    KVCacheManager.reap = _no_reap  # type: ignore[method-assign,assignment]
    from kvserve.cli import main as kvserve_main

    return kvserve_main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
