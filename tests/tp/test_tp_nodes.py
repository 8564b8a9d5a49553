"""Tensor parallelism across two "nodes" on loopback: `kvserve serve --tensor-parallel-size 2
--nnodes 2 --node-rank 0|1`, each its own process tree, meeting at MASTER_ADDR:MASTER_PORT as on
two machines. Node 0's openai client gets transformers' greedy tokens (which TP=1 matches); a
node 1 started with another --tensor-parallel-size and --model is a named error on both nodes;
killing node 1's process ends node 0's in-flight request with an error naming rank 1 and the
collective, /health turns 503, node 0 exits with code 3, and no rank process is left.
--nnodes without tensor parallelism is refused."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.cli import main
from tests.ops.processes import Server, free_port
from tests.runtime.conftest import random_prompt
from tests.tp.parity import complete, hf_tokens, openai_client, same
from tests.tp.ranks import child_pids, wait_gone

pytest.importorskip("transformers")
ARCH = "llama_gqa"
FLAGS = ("--block-size", "4", "--num-kv-blocks", "128", "--max-model-len", "256",
         "--num-threads", "1", "--drain-timeout", "1")
START_TIMEOUT_S = 120.0
EXIT_WITHIN_S = 30.0  # the heartbeat's verdict (5 s), the unhealthy grace (5 s), the exit


def start_node(model: Path, log_dir: Path, master_port: int, node_rank: int,
               tp: int = 2, nnodes: int = 2) -> Server:
    return Server(f"node{node_rank}", "kvserve.cli",
                  ["serve", "--model", str(model), "--tensor-parallel-size", str(tp),
                   "--nnodes", str(nnodes), "--node-rank", str(node_rank), *FLAGS], log_dir,
                  extra_env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})


@pytest.fixture(scope="module")
def nodes(tp_checkpoints, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    log_dir = tmp_path_factory.mktemp("tp-nodes")
    port = free_port()
    node0 = start_node(tp_checkpoints[ARCH], log_dir, port, 0)
    node1 = start_node(tp_checkpoints[ARCH], log_dir, port, 1)
    try:
        node0.wait_ready(lambda r: r.status_code == 200, START_TIMEOUT_S)
        assert node1.proc.poll() is None, node1.log()
        yield node0, node1
    finally:
        for node in (node0, node1):
            node.stop()


def test_a_mismatched_node_is_a_named_error_on_both_nodes(tp_checkpoints, tmp_path):
    port = free_port()
    node0 = start_node(tp_checkpoints[ARCH], tmp_path, port, 0)
    # One rank of a 4-way group (4 nodes of 1 rank), another model: both differences named.
    node1 = start_node(tp_checkpoints["qwen2_bias_tied"], tmp_path, port, 1, tp=4, nnodes=4)
    try:
        for node in (node0, node1):
            node.proc.wait(START_TIMEOUT_S)
            assert node.proc.returncode == 2, node.log()
    finally:
        for node in (node0, node1):
            node.stop()
    for node in (node0, node1):
        log = " ".join(node.log().split())  # rich wraps long lines
        assert "tensor-parallel rank 1 does not match rank 0" in log, log
        assert "--tensor-parallel-size: rank 1 has 4, rank 0 has 2" in log, log
        assert (f"--model: rank 1 has {tp_checkpoints['qwen2_bias_tied']} (config.json), "
                f"rank 0 has {tp_checkpoints[ARCH]} (config.json)") in log, log
    assert "cannot start" in node0.log()


def test_nodes_without_tensor_parallelism_are_refused(tp_checkpoints, capsys):
    assert main(["serve", "--model", str(tp_checkpoints[ARCH]), "--nnodes", "2",
                 "--node-rank", "1"]) == 2
    stderr = " ".join(capsys.readouterr().err.split())
    assert "give every node the same --tensor-parallel-size > 1" in stderr, stderr


def test_node_0_serves_greedy_parity(nodes, tp_checkpoints):
    node0, node1 = nodes
    client = openai_client(node0.url)
    for n in (5, 13):
        prompt = random_prompt(n, seed=600 + n)
        assert same(complete(client, prompt, 8), hf_tokens(tp_checkpoints[ARCH], prompt, 8))
    assert len(child_pids(node0.proc.pid)) == 0  # node 0 runs rank 0 alone
    assert len(child_pids(node1.proc.pid)) == 1  # node 1 runs rank 1


def test_killing_node_1_fails_node_0_with_the_rank_named(nodes):
    node0, node1 = nodes
    ranks = child_pids(node1.proc.pid)
    client = openai_client(node0.url)
    stream = client.completions.create(model=client.models.list().data[0].id, max_tokens=200,
                                       prompt=random_prompt(6, seed=7), temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    began = time.monotonic()
    with pytest.raises(openai.APIError) as failed:
        for i, _ in enumerate(stream):
            if i == 0:  # in flight: kill node 1's process (its rank exits with it)
                os.kill(node1.proc.pid, signal.SIGKILL)
    assert time.monotonic() - began < EXIT_WITHIN_S
    message = str(failed.value)
    assert re.search(r"tensor-parallel (all_reduce|all_gather|broadcast) failed at step \d+ "
                     r"\(rank_lost, rank 1\): rank 1 stopped beating", message), message
    wait_gone(ranks)
    health = httpx.get(f"{node0.url}/health", timeout=5.0)
    assert health.status_code == 503 and "rank 1" in health.json()["error"]
    assert httpx.get(f"{node0.url}/metrics", timeout=5.0).status_code == 200
    node0.proc.wait(EXIT_WITHIN_S)
    assert node0.proc.returncode == 3, node0.log()
