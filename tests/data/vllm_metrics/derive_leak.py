"""Write leak_1.prom .. leak_4.prom: the leak signature as vLLM would show it, derived from the
real recording after.prom with numbers changed (nothing here was scraped from a leaking worker).

Each scrape is after.prom (vLLM 0.32, idle after a burst: 0 running, 0 waiting) with
vllm:kv_cache_usage_perc set to 0.25 (8 of 32 blocks held by nobody) and the counters
untouched, as four scrapes of an idle worker that never frees those blocks would read.
Run from the repository root: python tests/data/vllm_metrics/derive_leak.py
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEAKED_USAGE = 0.25
SCRAPES = 4


def main() -> None:
    after = (HERE / "after.prom").read_text()
    leaked, n = re.subn(r"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+$",
                        rf"\g<1> {LEAKED_USAGE}", after, flags=re.M)
    assert n == 1, "after.prom has no vllm:kv_cache_usage_perc sample"
    for i in range(1, SCRAPES + 1):
        (HERE / f"leak_{i}.prom").write_text(leaked)


if __name__ == "__main__":
    main()
