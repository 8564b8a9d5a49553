"""A tensor-parallel rank other than 0: `python -m kvserve.runtime.tp_worker`.

Started by rank 0 (or torchrun, or `kvserve serve --node-rank k`) with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT (and LOCAL_RANK) set and the engine arguments as JSON in
KVSERVE_ENGINE_ARGS. It loads its shard, allocates the KV of its heads with as many blocks as
rank 0 publishes, and runs the plans rank 0 broadcasts until told to stop. Exit 0 after a clean
stop, 1 when the group failed (the error is logged), 2 for bad arguments.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from kvserve.model import allocate_kv_caches
from kvserve.model.runner import ModelRunner
from kvserve.model.sampler import Sampler
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.model_setup import load_rank_model, rank_device
from kvserve.runtime.tp_comm import Communicator, Heartbeat, TensorParallelError
from kvserve.runtime.tp_executor import serve_rank
from kvserve.runtime.tp_faults import Fault
from kvserve.runtime.tp_launch import (
    ARGS_VAR,
    NUM_BLOCKS_KEY,
    READY_KEY,
    STARTUP_TIMEOUT_S,
)

log = logging.getLogger("kvserve.tp_worker")


def run_rank(args: EngineArgs, rank: int, world_size: int, local_rank: int, master_addr: str,
             master_port: int) -> int:
    """Serve as `rank` until rank 0 stops the group; the process's exit code."""
    torch.set_num_threads(args.resolve_num_threads())
    store = TCPStore(master_addr, master_port, is_master=False,
                     timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    device = rank_device(args.device, local_rank)
    loaded, _ = load_rank_model(args, ShardSpec(rank, world_size), device)
    num_blocks = int(store.get(NUM_BLOCKS_KEY).decode())
    kv_caches = allocate_kv_caches(loaded.model.config, num_blocks, args.block_size,
                                   dtype=loaded.dtype, device=loaded.device)
    runner = ModelRunner(loaded.model, kv_caches, args.block_size,
                         Sampler(args.seed, loaded.device))
    store.set(READY_KEY.format(rank=rank), "1")
    comm = Communicator(store, rank, world_size, timeout_s=args.collective_timeout_s,
                        device=loaded.device)
    loaded.model.set_all_reduce(comm.all_reduce)
    Heartbeat(master_addr, master_port, comm)
    try:
        serve_rank(comm, runner, Fault.from_env())
    except TensorParallelError as exc:
        log.error("rank %d stops: %s", rank, exc)
        return 1
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s "
                        "%(message)s")
    env = os.environ
    try:
        args = EngineArgs(**json.loads(env[ARGS_VAR]))
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError, TypeError) as exc:
        print(f"kvserve tp_worker: needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and "
              f"{ARGS_VAR} ({exc!r})", file=sys.stderr)
        return 2
    return run_rank(args, rank, world_size, local_rank, addr, port)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: gloo's threads abort on it after a failed group
