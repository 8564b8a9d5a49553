"""The disk tier survives its filesystem filling up: its pages are reserved when it is created
(a full filesystem refuses the tier at start, with an error saying so), so a write into a slot
never faults. A sparse mapping instead took a SIGBUS, killing the worker, on the first write to
a page the full filesystem could not back (found by `python -m benchmarks chaos`'s disk_full).

Needs root (a tmpfs of a few MiB, mounted in a private mount namespace by `unshare -m`);
skipped, saying so, where that is not allowed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import os, sys, torch
from kvserve.model import allocate_disk_kv_caches
from kvserve.model.config import ModelConfig
from tests.model.arch_configs import base_config
root = sys.argv[1]
config = ModelConfig.from_dict(base_config())
slots = int(sys.argv[2])
try:
    disk = allocate_disk_kv_caches(config, slots, 16, dtype=torch.float32, path=root)
except ValueError as exc:
    print("REFUSED", exc)
    sys.exit(3)
print("TIER", disk.num_bytes, flush=True)
with open(os.path.join(root, "filler"), "wb", buffering=0) as f:  # fill it up
    try:
        while True:
            f.write(b"x" * 65536)
    except OSError:
        pass
for cache in disk.caches:  # every page of the tier written once
    cache.key_cache.fill_(1.0)
    cache.value_cache.fill_(2.0)
print("WROTE", flush=True)
"""


def _run_in_small_tmpfs(tmp_path: Path, slots: int) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs")
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "src"), str(repo)]))
    command = (f"mount -t tmpfs -o size=4m tmpfs {mount} || exit 97; "
               f"exec {sys.executable} {script} {mount} {slots}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True,
                          text=True, timeout=120, env=env)
    if done.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return done


def test_a_full_filesystem_does_not_kill_the_tier(tmp_path: Path) -> None:
    done = _run_in_small_tmpfs(tmp_path, slots=128)  # 1 MiB of the 4 MiB
    assert "TIER" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0 and "WROTE" in done.stdout, (
        f"exit {done.returncode} (-7: SIGBUS) writing the tier on a full filesystem:\n"
        f"{done.stdout}{done.stderr}")


def test_a_tier_the_filesystem_cannot_hold_is_refused_at_start(tmp_path: Path) -> None:
    done = _run_in_small_tmpfs(tmp_path, slots=1024)  # 8 MiB: more than the 4 MiB
    assert done.returncode == 3, done.stdout + done.stderr
    assert "REFUSED" in done.stdout and "room for it" in done.stdout, done.stdout
