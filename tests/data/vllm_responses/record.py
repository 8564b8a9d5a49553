"""Record vLLM's answers to tests/server/vllm_requests.py's CASES (run by hand, never by tests).

    PYTHONPATH=src:. python tests/data/vllm_responses/record.py \\
        --vllm-python ~/.cache/kvserve-peers/vllm-cpu/bin/python

writes the tiny random Llama of `vllm_requests.write_checkpoint` to a temporary directory,
serves it with vLLM's OpenAI server started with `vllm_requests.launch_line` (the very line
the tests start kvserve with), sends every case once and writes `<case>.json` next to this
script. Each file holds the request, the status, the content type and the body (or the SSE
chunks), and the peer's version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.server.harness import free_port
from tests.server.vllm_requests import (
    CASES,
    launch_line,
    send,
    write_chat_template,
    write_checkpoint,
)

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", required=True, help="the python of vLLM's venv")
    parser.add_argument("--log", default="vllm-record.log", help="vLLM's output goes here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "tiny-llama")
        template = write_chat_template(ckpt, Path(tmp) / "template.jinja")
        port = free_port()
        # `vllm serve MODEL ...` is api_server with `--model MODEL ...`: the `vllm` console
        # script of the vllm-cpu distribution does not start (PEERS.md), and api_server run
        # as a module ignores the positional model.
        model, *flags = launch_line(ckpt, template)
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                *flags, "--host", "127.0.0.1", "--port", str(port)]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0")
        with Path(args.log).open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            end = time.monotonic() + 900  # 30-60 s on an idle machine
            while True:
                if proc.poll() is not None:
                    sys.stderr.write(Path(args.log).read_text())
                    return 1
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError("vLLM did not start in 900 s")
                time.sleep(1)
            version = httpx.get(f"{url}/version").json()
            with httpx.Client(base_url=url, timeout=120) as client:
                for case in CASES:
                    recorded = send(client, case)
                    recorded["request"] = {"method": case.method, "path": case.path,
                                           "body": case.body}
                    recorded["peer"] = {"server": "vllm", **version}
                    (HERE / f"{case.name}.json").write_text(
                        json.dumps(recorded, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                    print(case.name, recorded["status"])
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
