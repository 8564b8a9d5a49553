"""A tensor-parallel rank other than 0: `python -m kvserve.runtime.tp.worker`.

Started by rank 0 (or torchrun, or `kvserve serve --node-rank k`) with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT (and LOCAL_RANK) set and the engine arguments as JSON in
KVSERVE_ENGINE_ARGS. It checks that its settings match rank 0's (tp_group_check), loads its
shard, allocates the KV of its heads with as many blocks as rank 0 publishes (with LoRA, slots
for its shard of the adapters too), and runs the plans rank 0 broadcasts until told to stop; it
exits when the process that started it does.
Exit 0 after a clean stop, 1 when the group failed or the parent is gone (the error is logged),
2 for bad arguments or settings that differ from rank 0's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from kvserve.model import allocate_kv_caches
from kvserve.model.runner import ModelRunner
from kvserve.model.sampler import Sampler
from kvserve.model.tensor_parallel import ShardSpec
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.lora_setup import rank_slots
from kvserve.runtime.model_setup import kv_cache_torch_dtype, load_rank_model, rank_device
from kvserve.runtime.tp.comm import (
    HEARTBEAT_INTERVAL_S,
    Communicator,
    Heartbeat,
    TensorParallelError,
)
from kvserve.runtime.tp.executor import serve_rank
from kvserve.runtime.tp.faults import Fault
from kvserve.runtime.tp.group_check import check_identity
from kvserve.runtime.tp.launch import (
    ARGS_VAR,
    NUM_BLOCKS_KEY,
    READY_KEY,
    STARTUP_TIMEOUT_S,
)

log = logging.getLogger("kvserve.tp_worker")


def run_rank(args: EngineArgs, rank: int, world_size: int, local_rank: int, master_addr: str,
             master_port: int) -> int:
    """Serve as `rank` until rank 0 stops the group; the process's exit code."""
    exit_with_parent(rank)
    leave_stopping_to_rank_0()
    torch.set_num_threads(args.resolve_num_threads())
    store = TCPStore(master_addr, master_port, is_master=False,
                     timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    try:
        check_identity(store, args, rank)
    except TensorParallelError as exc:
        log.error("rank %d refuses to join: %s", rank, exc)
        return 2
    device = rank_device(args.device, local_rank)
    loaded, _ = load_rank_model(args, ShardSpec(rank, world_size), device)
    num_blocks = int(store.get(NUM_BLOCKS_KEY).decode())
    kv_caches = allocate_kv_caches(loaded.model.config, num_blocks, args.block_size,
                                   dtype=kv_cache_torch_dtype(args, loaded.dtype),
                                   device=loaded.device)
    runner = ModelRunner(loaded.model, kv_caches, args.block_size,
                         Sampler(args.seed, loaded.device))
    adapters = rank_slots(args, loaded) if args.enable_lora else None
    store.set(READY_KEY.format(rank=rank), "1")
    comm = Communicator(store, rank, world_size, timeout_s=args.collective_timeout_s,
                        device=loaded.device)
    loaded.model.set_all_reduce(comm.all_reduce)
    Heartbeat(master_addr, master_port, comm)
    try:
        serve_rank(comm, runner, Fault.from_env(), adapters)
    except TensorParallelError as exc:
        log.error("rank %d stops: %s", rank, exc)
        return 1
    return 0


def exit_with_parent(rank: int) -> None:
    """End this process when its parent (rank 0, `kvserve serve --node-rank k`, torchrun's
    agent) is gone: an orphaned rank would keep its share of the model and its sockets, and
    rank 0 would never learn that the node was stopped."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(HEARTBEAT_INTERVAL_S)
        log.error("rank %d stops: the process that started it (pid %d) is gone", rank, parent)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


def leave_stopping_to_rank_0() -> None:
    """Ignore SIGINT and SIGTERM: they reach every rank at once (Ctrl-C in a terminal, torchrun
    stopping its workers), and rank 0 still needs this rank to finish the requests it drains.
    The rank stops when rank 0 says so, or when rank 0 or the parent is gone."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
