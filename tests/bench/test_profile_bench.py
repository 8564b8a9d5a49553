"""`python -m benchmarks profile`: a quick real measurement that the simulator can load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import with_repo_on_path
from kvserve.runtime.demo_model import ensure_demo_model
from kvserve.sim.profiles import load_profile


def test_a_quick_profile_with_a_real_server_loads_into_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    # The small random-weight demo model: the default (the real 30-layer model) takes minutes.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "profile", "--quick", "--server",
         "--model", str(ensure_demo_model()),
         "--threads", "1", "--repeats", "1", "--decode-steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=with_repo_on_path(os.environ),
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chunked prefill of 512 tokens" in proc.stderr
    assert "request overhead" in proc.stderr
    profile = load_profile(str(out))
    assert profile.name == "kvserve" and "1 threads" in profile.source
    # The overhead is measured and fitted (a timing: on a busy machine the fit may clamp it at
    # 0, so its size belongs in benchmarks, not in this test).
    assert profile.request_overhead_ms >= 0.0
    assert profile.request_overhead_ms_per_prompt_token >= 0.0
    assert profile.prefill_ms_per_token > 0.0 and profile.decode_base_ms > 0.0
    assert " after 384" in proc.stdout  # a chunk late in the prompt was timed and fitted
