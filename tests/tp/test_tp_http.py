"""`kvserve serve --tensor-parallel-size 2` through the official openai client: greedy parity
with transformers for a concurrent mixed batch under chunked prefill and forced preemption, a
warm prefix cache, the collective metrics on /metrics, and the faults a live group can suffer
(a slow rank, a stalled rank, a lost rank, a divergent rank): each ends the affected requests
with an error naming the rank and the collective, frees every block, reports unhealthy, and
the worker exits non-zero; none hangs."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.runtime.conftest import random_prompt
from tests.server.harness import ServerProcess, wait_until
from tests.tp.parity import complete, hf_tokens, openai_client, same
from tests.tp.ranks import child_pids, wait_gone

pytest.importorskip("transformers")
TP_FLAGS = ("--tensor-parallel-size", "2", "--block-size", "4")
EXIT_WITHIN_S = 30.0
# How long a failed worker keeps answering /health 503 before it exits (5 s in production):
# long enough for the checks below, which read /health as soon as the request has failed.
FAILED_GROUP_GRACE_S = "2"


@pytest.fixture
def start(tp_checkpoints, tmp_path, monkeypatch):
    started: list[ServerProcess] = []

    def run(arch: str, flags: tuple[str, ...] = (), fault: str | None = None) -> ServerProcess:
        monkeypatch.setenv("KVSERVE_TEST_HOOKS", "1")
        monkeypatch.setenv("KVSERVE_TEST_FAILED_GROUP_GRACE_S", FAILED_GROUP_GRACE_S)
        if fault is not None:
            monkeypatch.setenv("KVSERVE_TP_FAULT", fault)
        server = ServerProcess(tp_checkpoints[arch], tmp_path, (*TP_FLAGS, *flags))
        started.append(server)
        server.wait_healthy(timeout_s=120.0)
        return server

    yield run
    for server in started:
        server.stop()
        wait_gone(getattr(server, "rank_pids", []))


def test_openai_client_parity_under_chunked_prefill_and_preemption(start, tp_checkpoints):
    arch = "qwen2_one_kv_head"
    server = start(arch, ("--max-num-batched-tokens", "6", "--num-kv-blocks", "16"))
    server.rank_pids = child_pids(server.proc.pid)
    assert len(server.rank_pids) == 1
    client = openai_client(server.url)
    prompts = [random_prompt(n, seed=400 + n) for n in (5, 9, 14, 21)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(client, p, 16), prompts))
    path = tp_checkpoints[arch]
    for prompt, tokens in zip(prompts, got, strict=True):
        assert same(tokens, hf_tokens(path, prompt, 16)), (tokens, hf_tokens(path, prompt, 16))
    metrics = server.metrics()
    assert metrics.value("vllm:num_preemptions_total") > 0
    # A warm prefix: the second request reads 16 cached prompt tokens from both ranks' caches.
    prefix = random_prompt(16, seed=9)
    complete(client, prefix + random_prompt(2, seed=10), 4)
    warm = prefix + random_prompt(3, seed=11)
    before = server.metrics().value("vllm:prefix_cache_hits_total")
    assert same(complete(client, warm, 8), hf_tokens(path, warm, 8))
    metrics = server.metrics()
    assert metrics.value("vllm:prefix_cache_hits_total") - before >= 16
    assert metrics.value("kvserve:collective_duration_seconds_count", op="all_reduce",
                         backend="gloo") > 0
    assert metrics.value("kvserve:collective_errors_total") == 0
    assert metrics.value("kvserve:tensor_parallel_size") == 2
    wait_until(lambda: server.metrics().value("kvserve:kv_held_blocks") == 0, 10.0,
               "no block held")


def test_a_slow_rank_shows_as_skew_and_finishes(start, tp_checkpoints):
    server = start("llama_gqa", ("--collective-timeout", "30"), fault="1:3:delay:1.5")
    prompt = random_prompt(7, seed=1)
    assert same(complete(openai_client(server.url), prompt, 6),
                 hf_tokens(tp_checkpoints["llama_gqa"], prompt, 6))
    metrics = server.metrics()
    assert metrics.value("kvserve:collective_rank_skew_seconds_sum") >= 1.4
    slow = metrics.value("kvserve:collective_duration_seconds_count", op="all_reduce") \
        - metrics.value("kvserve:collective_duration_seconds_bucket", op="all_reduce", le="1.0")
    assert slow == 1  # the one all_reduce that waited for the slow rank
    assert metrics.value("kvserve:collective_errors_total") == 0


@pytest.mark.parametrize(("fault", "words", "kind", "op"), [
    ("1:3:delay:60", ["all_reduce", "timeout", "rank 1", "still in compute of step 3"],
     "timeout", "all_reduce"),
    ("1:3:exit", ["rank_lost", "rank 1", "exited with code 17"], "rank_lost", "all_gather"),
    ("1:3:diverge", ["rank 1 diverged at step 3", "the step was not run"], None, None),
])
def test_a_failed_rank_ends_requests_with_a_named_error(start, fault, words, kind, op):
    server = start("llama_gqa", ("--collective-timeout", "3"), fault=fault)
    server.rank_pids = child_pids(server.proc.pid)
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failed:
        complete(openai_client(server.url), random_prompt(9, seed=2), 20)
    assert time.monotonic() - began < 30.0  # no hang: the watchdog's 3 s and the diagnosis
    assert failed.value.status_code == 503
    for word in words:
        assert word in str(failed.value), str(failed.value)
    health = httpx.get(f"{server.url}/health", timeout=5.0)
    assert health.status_code == 503 and "rank 1" in health.json()["error"]
    metrics = server.metrics()
    assert metrics.value("kvserve:kv_held_blocks") == 0
    assert metrics.value("vllm:num_requests_running") == 0
    if kind is not None:
        assert metrics.value("kvserve:collective_errors_total", op=op, kind=kind) == 1
    else:
        assert metrics.value("kvserve:tp_step_divergences_total") == 1
    server.proc.wait(EXIT_WITHIN_S)
    assert server.proc.returncode == 3, server.log()


def test_a_rank_lost_while_idle_makes_the_worker_unhealthy(start):
    server = start("llama_gqa")
    complete(openai_client(server.url), random_prompt(5, seed=3), 3)
    server.rank_pids = child_pids(server.proc.pid)
    os.kill(server.rank_pids[0], 9)
    wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5.0).status_code == 503, 10.0,
               "/health to report the lost rank")
    error = httpx.get(f"{server.url}/health", timeout=5.0).json()["error"]
    assert "rank 1" in error and "rank_lost" in error and "code -9" in error, error
    server.proc.wait(EXIT_WITHIN_S)
    assert server.proc.returncode == 3
