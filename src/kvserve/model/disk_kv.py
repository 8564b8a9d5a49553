"""The disk tier's KV tensors: the host tier's slot layout, memory-mapped from one file.

The tier's bytes live on disk, not in the process's anonymous memory: writes go to the page
cache and the kernel writes them back as it sees fit. Nothing from an earlier process is ever
trusted, and nothing kvserve did not create is ever written: given a directory, the file is new
(a unique name, created exclusively, mode 0600) and is unlinked as soon as it is mapped, so no
later process can open it; given a file path, a new file is created exclusively with a header
that marks it as kvserve's, and an existing one is reused only if it carries that header and no
other process holds it (an exclusive lock) — then it is zeroed. A symbolic link is never
followed. The cache's bookkeeping (kvserve.kvcache) starts empty either way, so no slot is
readable before this process wrote it. No flush is needed: the mapping is the only reader and
the bytes need not survive the process. The file's blocks are allocated when it is created, so
a filesystem that fills up later cannot fail a write into the mapping (a SIGBUS).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.paged_attention import KVCache

HEADER = b"kvserve disk KV tier v1\n"  # the first bytes of every file kvserve made
HEADER_BYTES = mmap.ALLOCATIONGRANULARITY  # the slots start here (a mapping offset)


@dataclass(frozen=True, slots=True)
class DiskKV:
    """The disk tier's per-layer caches, each K and V [num_slots, block_size, kv_heads, hd],
    views of one file mapping; `path` names the file (already unlinked when it was created in a
    directory)."""

    caches: list[KVCache]
    path: Path
    num_bytes: int
    mapping: mmap.mmap  # keeps the views' memory (and the file's lock) alive


def allocate_disk_kv_caches(config: ModelConfig, num_slots: int, block_size: int, *,
                            dtype: torch.dtype, path: str | os.PathLike[str]) -> DiskKV:
    """Map `num_slots` zeroed slots onto a file under `path` (an existing directory: a new
    file in it; otherwise a file kvserve creates, or one it created before; see the module
    doc). Raises ValueError, saying what to change, when `path` cannot hold the tier."""
    if num_slots < 1:
        raise ValueError(f"a disk tier needs at least one slot, got {num_slots}")
    shape = (config.num_hidden_layers, 2, num_slots, block_size, config.num_key_value_heads,
             config.head_dim)
    numel = 1
    for dim in shape:
        numel *= dim
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    target = Path(path)
    try:
        fd, file, in_directory = _open_tier_file(target)
        try:
            os.ftruncate(fd, HEADER_BYTES)  # drops whatever slots an earlier process left
            os.pwrite(fd, HEADER, 0)
            os.ftruncate(fd, HEADER_BYTES + num_bytes)  # zero-filled: no stale byte is read
            # Reserved now: a sparse file's pages are allocated on first write, and a write
            # into the mapping that the filesystem (full by then) cannot back is a SIGBUS.
            os.posix_fallocate(fd, HEADER_BYTES, num_bytes)
            mapping = mmap.mmap(fd, num_bytes, offset=HEADER_BYTES)  # holds a dup of fd
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"cannot create the disk KV tier ({num_bytes} bytes) at {target}: "
                         f"{exc.strerror or exc}; give a writable directory or file path with "
                         "room for it, or a smaller kv_disk_tier_bytes") from exc
    if in_directory:
        file.unlink()  # the mapping keeps the bytes; no other process can find them
    flat = torch.frombuffer(mapping, dtype=dtype, count=numel)  # [numel]
    tiers = flat.view(shape)  # [layers, 2, num_slots, block_size, kv_heads, hd]
    caches = [KVCache(tiers[layer, 0], tiers[layer, 1]) for layer in range(shape[0])]
    return DiskKV(caches, file, num_bytes, mapping)


def _open_tier_file(target: Path) -> tuple[int, Path, bool]:
    """(fd, path, created in a directory) of the file the tier may use at `target`, locked
    for this process. Raises ValueError for a path kvserve must not write, OSError otherwise."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{target} is a symbolic link; kvserve does not follow links for the "
                         "disk tier: give the real directory or a new file's path")
    if info is not None and stat.S_ISDIR(info.st_mode):
        dir_fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            name = f"kvserve-kv-{os.getpid()}-{secrets.token_hex(8)}.bin"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        return fd, target / name, True
    if info is None:  # a new file: nobody else can hold it yet
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, target, False
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{target} is not a regular file or a directory; give a directory or "
                         "a new file's path for the disk tier")
    fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW)
    try:
        _lock(fd, target)
        if os.pread(fd, len(HEADER), 0) != HEADER:
            raise ValueError(f"{target} exists and kvserve did not create it, so it will not "
                             "overwrite it: give a directory (a new file is made there), a new "
                             "file's path, or remove the file yourself")
    except BaseException:
        os.close(fd)
        raise
    return fd, target, False


def _lock(fd: int, target: Path) -> None:
    """Hold `fd`'s file for this process (the lock lives as long as the mapping's dup of it);
    ValueError when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise ValueError(f"{target} is the disk tier of another running kvserve process; give "
                         "each process its own path (a directory gives each its own file)") \
            from None
