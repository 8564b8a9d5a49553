"""The disk tier's file (kvserve.model.disk_kv) never truncates, follows or shares a path kvserve
did not create: a symbolic link, a foreign file, another directory's files and a file another
process holds are refused with a clear error and left exactly as they were."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.model import allocate_disk_kv_caches
from kvserve.model.config import ModelConfig
from kvserve.model.disk_kv import HEADER, HEADER_BYTES
from tests.model.arch_configs import base_config

CONFIG = ModelConfig.from_dict(base_config())
FOREIGN = b"somebody's precious data\n"


def allocate(path: Path, num_slots: int = 4):  # type: ignore[no-untyped-def]
    return allocate_disk_kv_caches(CONFIG, num_slots, 16, dtype=torch.float32, path=path)


def test_a_new_file_is_created_private_marked_and_zeroed(tmp_path: Path) -> None:
    path = tmp_path / "tier.bin"
    disk = allocate(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes()[:len(HEADER)] == HEADER
    assert path.stat().st_size == HEADER_BYTES + disk.num_bytes
    cache = disk.caches[0]
    assert float(cache.key_cache.abs().sum()) == 0.0
    cache.key_cache.fill_(3.0)  # writes reach the file, past the header
    with path.open("rb") as f:
        f.seek(HEADER_BYTES)
        assert torch.frombuffer(bytearray(f.read(16)), dtype=torch.float32).tolist() == [3.0] * 4


def test_a_file_kvserve_made_is_reused_and_zeroed(tmp_path: Path) -> None:
    path = tmp_path / "tier.bin"
    first = allocate(path)
    first.caches[1].value_cache.fill_(7.0)
    del first
    second = allocate(path, num_slots=2)
    assert all(float(c.key_cache.abs().sum()) == 0.0 and float(c.value_cache.abs().sum()) == 0.0
               for c in second.caches)
    assert path.stat().st_size == HEADER_BYTES + second.num_bytes


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(FOREIGN)
    link = tmp_path / "tier.bin"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        allocate(link)
    assert target.read_bytes() == FOREIGN and link.is_symlink()
    linked_dir = tmp_path / "dir-link"
    linked_dir.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        allocate(linked_dir)


def test_an_existing_file_kvserve_did_not_make_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "tier.bin"
    path.write_bytes(FOREIGN)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="kvserve did not create it"):
        allocate(path)
    assert path.read_bytes() == FOREIGN and stat.S_IMODE(path.stat().st_mode) == 0o644
    empty = tmp_path / "empty"
    empty.touch()
    with pytest.raises(ValueError, match="kvserve did not create it"):
        allocate(empty)
    assert empty.stat().st_size == 0


def test_a_directory_gets_a_new_unlinked_file_and_its_files_stay(tmp_path: Path) -> None:
    other = tmp_path / "kvserve-kv-1-0000000000000000.bin"
    other.write_bytes(FOREIGN)
    disk = allocate(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]  # new file unlinked
    assert other.read_bytes() == FOREIGN and disk.path.parent == tmp_path
    disk.caches[0].key_cache.fill_(1.0)  # still a working mapping


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        allocate(fifo)


def test_a_file_in_use_by_another_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tier.bin"
    allocate(path).caches[0].key_cache.fill_(5.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
         str(path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        with pytest.raises(ValueError, match="another running kvserve process"):
            allocate(path)
        with path.open("rb") as f:  # untouched: not truncated, not zeroed
            f.seek(HEADER_BYTES)
            assert torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32).item() == 5.0
    finally:
        holder.kill()
        holder.wait()
