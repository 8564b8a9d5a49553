"""`python -m benchmarks router-cpu` and its stub workers: real processes on loopback ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import with_repo_on_path
from benchmarks.__main__ import main as benchmarks_main
from benchmarks.stub_worker import StubWorker
from kvserve.gateway.fleet.scraper import read_series


def test_the_stub_worker_streams_its_tokens_and_reports_vllm_series(tmp_path: Path) -> None:
    with StubWorker(0, 5, 0.0, tmp_path) as worker, httpx.Client(timeout=10.0) as client:
        with client.stream("POST", f"{worker.url}/v1/completions",
                           json={"prompt": "x" * 400, "stream": True}) as response:
            assert response.headers["content-type"] == "text/event-stream"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["text"] for c in chunks[:5]] == [" x"] * 5
        assert chunks[5]["usage"]["completion_tokens"] == 5
        assert chunks[5]["usage"]["prompt_tokens"] == 100
        whole = client.post(f"{worker.url}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert whole["choices"][0]["message"]["content"] == " x" * 5
        series = read_series(client.get(f"{worker.url}/metrics").text)
        assert series["kv_capacity_tokens"] == 16384 and series["num_waiting"] == 0
        assert client.get(f"{worker.url}/v1/models").json()["data"][0]["root"] == "stub"
        assert client.post(f"{worker.url}/v1/completions", content=b"{nope").status_code == 400


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = with_repo_on_path(dict(os.environ, PEERS=str(tmp_path / "no-peers")))
    env.pop("KVSERVE_SGLANG_ROUTER", None)
    return subprocess.run([sys.executable, "-m", "benchmarks", "router-cpu", *args],
                          capture_output=True, text=True, timeout=240, env=env, check=False)


def test_the_stub_worker_reads_a_chunked_body(tmp_path: Path) -> None:
    """Envoy re-chunks a body its ext_proc filter rewrote (the Endpoint Picker's)."""
    body = json.dumps({"model": "stub", "prompt": "hello " * 50}).encode()
    parts = iter([body[:7], body[7:100], body[100:]])
    with StubWorker(0, 3, 0.0, tmp_path) as worker, httpx.Client(timeout=10.0) as client:
        answer = client.post(f"{worker.url}/v1/completions", content=parts,
                             headers={"content-type": "application/json"})
        assert answer.request.headers["transfer-encoding"] == "chunked"
        assert answer.status_code == 200
        assert answer.json()["usage"]["prompt_tokens"] == len("hello " * 50) // 4


def test_each_router_is_measured_and_a_missing_peer_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    proc = _bench(tmp_path, "--routers", "kvserve:cache_aware,sglang:cache_aware",
                  "--requests", "60", "--repeats", "1", "--idle-seconds", "0.5",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sglang:cache_aware: skipped" in proc.stderr
    assert "SGLang's router is not installed" in proc.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["router"] == "kvserve:cache_aware" and run["failed"] == 0
    assert run["requests"] == 60 and run["requests_per_s"] > 0
    assert run["cpu_ms_per_request"] > 0 and run["idle_cpu_ms_per_s"] >= 0
    assert "router CPU behind stub workers" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--routers", "ideal"], "drop 'ideal'"),
    (["--routers", "kvserve:cache_aware", "--requests", "0"], "--requests must be >= 1"),
    (["--routers", "nginx:rr"], "use 'ideal' or KIND:POLICY"),
    (["--token-interval", "-1"], "--token-interval must be within 0-10 s"),
])
def test_bad_arguments_are_refused_before_any_process(args: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the command's own `main`, as `python -m benchmarks` calls it (the
    # subprocess test above covers that entry), without a new interpreter importing torch.
    assert benchmarks_main(["router-cpu", *args]) == 2
    stderr = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert message in stderr, stderr
