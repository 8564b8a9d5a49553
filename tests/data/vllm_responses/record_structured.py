"""Record vLLM's answers to the structured-output and tool-call requests that
tests/server/test_tool_calls_http.py sends kvserve (run by hand; no test needs vLLM):

    PYTHONPATH=src python tests/data/vllm_responses/record_structured.py [NAME ...]

It writes the same tiny random checkpoint the test serves, starts vLLM's CPU build on it
(kvserve.bench.server_launch), sends each request of `structured_requests.REQUESTS` and saves
the bodies (a stream as its list of chunks) to structured_responses.json beside this file;
given NAMEs, only those requests are sent and their answers replace the recorded ones.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvserve.bench.server_launch import VLLM, LaunchedServer, LaunchSpec
from kvserve.model import write_random_checkpoint
from tests.data.vllm_responses.structured_requests import REQUESTS, shape_model


def main() -> None:
    only = set(sys.argv[1:])
    unknown = only - set(REQUESTS)
    if unknown:
        raise SystemExit(f"no such request: {', '.join(sorted(unknown))}")
    target = Path(__file__).with_name("structured_responses.json")
    recorded = json.loads(target.read_text(encoding="utf-8")) if only else {"responses": {}}
    root = Path(tempfile.mkdtemp(prefix="record-structured-"))
    path = write_random_checkpoint(root / "tiny-llama", shape_model(), seed=7)
    spec = LaunchSpec(path, "tiny-llama", kv_cache_bytes=64 << 20, max_model_len=1024,
                      max_num_seqs=4, max_num_batched_tokens=1024, num_threads=1,
                      vllm_eager=True,
                      # vLLM 0.32 refuses tool_choice "required" and named without a parser.
                      extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    out: dict[str, object] = recorded["responses"]
    with LaunchedServer(VLLM, spec, root, startup_timeout_s=900) as server, \
            httpx.Client(base_url=server.url, timeout=300.0) as client:
        version = client.get("/version").json().get("version")
        for name, body in REQUESTS.items():
            if only and name not in only:
                continue
            body = {"model": "tiny-llama"} | body
            if body.get("stream"):
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    chunks = [json.loads(line[6:]) for line in response.iter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                out[name] = {"status": response.status_code, "chunks": chunks}
            else:
                response = client.post("/v1/chat/completions", json=body)
                out[name] = {"status": response.status_code, "body": response.json()}
    target.write_text(json.dumps({"vllm_version": version, "responses": out}, indent=1) + "\n",
                      encoding="utf-8")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
