"""Record a server's /metrics idle, during a burst that fills its KV cache, and after it.

Run by hand (never by the tests), from the repository root:

    PYTHONPATH=src python tests/data/vllm_metrics/record.py --server vllm \
        --out tests/data/vllm_metrics

The server runs a tiny random Llama (tests/model/arch_configs.py base_config, head dim 32)
with a 32-block KV cache, so 16 concurrent 250-token requests fill it and the rest wait.
Writes idle.prom, burst.prom and burst_2.prom (the first two consecutive burst scrapes with
KV usage >= 0.95 and requests waiting), after.prom (2 s after the burst), and burst_series.txt
(usage, running, waiting of every burst scrape, 0.5 s apart).
`--hold S` keeps the server up S seconds after recording (and prints its URL), for a live
`kvserve doctor`; `--burst-s` sets how long the burst keeps the server full.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvserve.bench.server_launch import LaunchedServer, LaunchSpec
from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config

# head dim 32: vLLM's CPU attention has no kernel for base_config's 16
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4}
BLOCK_BYTES = 2 * 2 * 4 * 32 * 4 * 128  # K, V x 2 layers x 4 KV heads x dim 32 x fp32 x 128
NUM_BLOCKS = 32
PROMPT_TOKENS = 200
OUTPUT_TOKENS = 48


def gauges(text: str) -> tuple[float, float, float]:
    def first(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return float("nan")
    return (first("vllm:kv_cache_usage_perc"), first("vllm:num_requests_running"),
            first("vllm:num_requests_waiting"))


def burst(url: str, model: str, seconds: float, clients: int, stop: threading.Event) -> None:
    """`clients` threads sending 200-token prompts (a shared 128-token prefix) until `seconds`."""
    prefix = [random.Random(0).randrange(3, 290) for _ in range(128)]
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < end and not stop.is_set():
                prompt = prefix + [rng.randrange(3, 290) for _ in range(PROMPT_TOKENS - 128)]
                http.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                    "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", choices=("vllm", "kvserve"), default="vllm")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--burst-s", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--log-dir", type=Path, default=None, help="keep the server log here")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp) / "model", base_config(**MODEL))
        spec = LaunchSpec(model_dir=model_dir, served_model_name="tiny-llama",
                          kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES, max_model_len=256,
                          max_num_seqs=32, max_num_batched_tokens=4096, num_threads=1,
                          block_size=128, vllm_eager=True)
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        with LaunchedServer(args.server, spec, log_dir, startup_timeout_s=300) as server:
            url = server.url
            with httpx.Client(timeout=30) as http:
                # one request first, so the histograms and counters have series
                http.post(f"{url}/v1/completions", json={
                    "model": "tiny-llama", "prompt": list(range(3, 203)), "max_tokens": 8,
                    "temperature": 0})
                time.sleep(1.0)
                (args.out / "idle.prom").write_text(http.get(f"{url}/metrics").text)
                stop = threading.Event()
                sender = threading.Thread(target=burst, args=(url, "tiny-llama", args.burst_s,
                                                              args.clients, stop))
                sender.start()
                scrapes, series = [], []
                while sender.is_alive():
                    text = http.get(f"{url}/metrics").text
                    usage, running, waiting = gauges(text)
                    series.append(f"{time.monotonic():.2f} {usage:.4f} {running:.0f} "
                                  f"{waiting:.0f}")
                    scrapes.append((text, usage, waiting))
                    time.sleep(0.5)
                sender.join()
                # two consecutive scrapes of a full cache with requests waiting, else the fullest
                full = [i for i in range(len(scrapes) - 1)
                        if all(u >= 0.95 and w > 0 for _, u, w in scrapes[i:i + 2])]
                i = full[0] if full else max(range(len(scrapes) - 1),
                                             key=lambda j: scrapes[j][1:])
                best_key = scrapes[i][1:]
                (args.out / "burst.prom").write_text(scrapes[i][0])
                (args.out / "burst_2.prom").write_text(scrapes[i + 1][0])
                (args.out / "burst_series.txt").write_text(
                    "# monotonic_s kv_cache_usage_perc running waiting\n"
                    + "\n".join(series) + "\n")
                time.sleep(2.0)
                (args.out / "after.prom").write_text(http.get(f"{url}/metrics").text)
            print(f"recorded into {args.out}; peak usage {best_key[0]}, waiting {best_key[1]}")
            if args.hold:
                print(f"holding {url} for {args.hold:.0f}s", flush=True)
                time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
