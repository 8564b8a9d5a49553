"""Tensor parallelism under torch's own launcher: `python -m torch.distributed.run
--nproc-per-node 2 --master-addr 127.0.0.1 --master-port P -m kvserve serve -tp 2 ...` starts
both ranks with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (and its agent's
store at MASTER_PORT); kvserve starts nothing. Rank 0 serves transformers' greedy tokens; when
torchrun is stopped (SIGTERM to every rank at once) rank 0 drains the request in flight, rank 1
leaves when told, and every process is gone well before torchrun's SIGKILL. Also the
environment contract itself: what `Rendezvous.from_env` takes and refuses."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import pytest

from kvserve.runtime import EngineArgs, LLMEngine
from kvserve.runtime.tp.launch import Rendezvous
from tests.ops.processes import Server, free_port
from tests.runtime.conftest import random_prompt
from tests.tp.parity import complete, hf_tokens, openai_client, same
from tests.tp.ranks import child_pids, wait_gone

pytest.importorskip("transformers")
ARCH = "qwen2_bias_tied"
FLAGS = ("--tensor-parallel-size", "2", "--block-size", "4", "--num-kv-blocks", "128",
         "--max-model-len", "256", "--num-threads", "1", "--drain-timeout", "20")
START_TIMEOUT_S = 120.0
STOP_WITHIN_S = 25.0  # torchrun sends SIGKILL 30 s after SIGTERM: a clean stop is sooner
# Rank 1 sleeps 50 ms before every step, so a 40-token request is still in flight when
# torchrun is stopped after its first chunk (and drains well within --drain-timeout).
SLOW = {"KVSERVE_TEST_HOOKS": "1", "KVSERVE_TP_FAULT": "1:1-100000:delay:0.05"}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def torchrun(tp_checkpoints, tmp_path_factory) -> Iterator[Server]:
    launcher = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "kvserve", "serve",
                "--model", str(tp_checkpoints[ARCH]), *FLAGS]
    server = Server("torchrun", "torch.distributed.run", launcher,
                    tmp_path_factory.mktemp("torchrun"), extra_env=SLOW)
    try:
        server.wait_ready(lambda r: r.status_code == 200, START_TIMEOUT_S)
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()  # its ranks follow (tp_worker.exit_with_parent)
            server.proc.wait(10.0)


def test_rank_0_serves_greedy_parity(torchrun, tp_checkpoints):
    assert len(child_pids(torchrun.proc.pid)) == 2  # torchrun's two ranks; kvserve spawned none
    client = openai_client(torchrun.url)
    for n in (4, 11):
        prompt = random_prompt(n, seed=700 + n)
        assert same(complete(client, prompt, 8), hf_tokens(tp_checkpoints[ARCH], prompt, 8))


def test_stopping_torchrun_drains_and_stops_every_rank(torchrun):
    ranks = child_pids(torchrun.proc.pid)
    client = openai_client(torchrun.url)
    stream = client.completions.create(model=client.models.list().data[0].id,
                                       max_tokens=MAX_TOKENS, prompt=random_prompt(6, seed=8),
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       logprobs=0,  # a chunk per token, even one with no text
                                       extra_body={"ignore_eos": True})
    stopped, chunks = 0.0, []
    for chunk in stream:
        if not chunks:  # in flight: stop torchrun, which sends SIGTERM to both ranks
            stopped = time.monotonic()
            torchrun.proc.send_signal(signal.SIGTERM)
        chunks.append(chunk)
    assert chunks[0].choices and not chunks[0].choices[0].finish_reason, torchrun.log()
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS  # drained: rank 1 stayed
    torchrun.proc.wait(STOP_WITHIN_S)
    wait_gone(ranks, STOP_WITHIN_S - (time.monotonic() - stopped))
    log = torchrun.log()
    assert "rank 1 stops" not in log and "CollectiveError" not in log, log
    assert "got signal: 15" in log  # torchrun's own exit on the signal, after its workers


@pytest.mark.parametrize(("env", "nnodes", "node_rank", "error"), [
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}, 1, 0,
     "WORLD_SIZE=4 but tensor_parallel_size is 2"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, 1, 0, "need MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, 2, 1,
     "under torchrun, place the ranks with torchrun's own --nnodes and --node-rank"),
    ({}, 2, 0, "need MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_PORT": "29500"}, 2, 2, "--node-rank must be in [0, --nnodes), got 2 of 2"),
])
def test_the_environment_contract_refuses_what_cannot_meet(monkeypatch, env, nnodes,
                                                           node_rank, error):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape(error)):
        Rendezvous.from_env(2, nnodes, node_rank)


def test_torchruns_variables_make_a_launched_rendezvous(monkeypatch):
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)
    assert Rendezvous.from_env(2) == Rendezvous("10.0.0.7", 29511, 2, 1, 0, launched=True,
                                                rank=1)


def test_only_torchruns_rank_0_builds_an_engine(monkeypatch, tp_checkpoints):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="torchrun's rank 1: only rank 0 builds the engine"):
        LLMEngine.from_args(EngineArgs(model=str(tp_checkpoints[ARCH]), tensor_parallel_size=2))
