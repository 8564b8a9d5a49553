"""Starting a tensor-parallel group: one process per rank, torchrun's environment, the store.

`kvserve serve --tensor-parallel-size N` (or `LLM(..., tensor_parallel_size=N)`) is rank 0: it
opens the TCP store at MASTER_ADDR:MASTER_PORT (default 127.0.0.1 and a free port) and starts
this node's other ranks as `python -m kvserve.runtime.tp.worker` with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun sets them. With `--nnodes M`, node k > 0
runs `kvserve serve ... --nnodes M --node-rank k` with the same MASTER_ADDR/MASTER_PORT: it
starts its N/M ranks and waits for them (they exit with it).

Under torchrun each process is its rank and kvserve starts nothing. torchrun's contract: it
runs --nproc-per-node copies of the same command line per node, each with RANK, LOCAL_RANK,
WORLD_SIZE (= nodes x nproc-per-node), MASTER_ADDR and MASTER_PORT set, and with
TORCHELASTIC_USE_AGENT_STORE=True when its agent already serves the TCP store at MASTER_PORT
(rank 0 then joins that store instead of opening one); to stop, it sends every copy SIGTERM
and SIGKILL 30 s later. So WORLD_SIZE must equal --tensor-parallel-size, RANK 0 serves HTTP,
and the other ranks ignore SIGTERM and leave when rank 0, having drained, tells them to.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from kvserve.model.runner import ModelRunner
from kvserve.runtime.collective_stats import CollectiveErrorKind, CollectiveStats
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.tp.comm import (
    HEARTBEAT_INTERVAL_S,
    Communicator,
    HeartbeatReader,
    TensorParallelError,
    classify,
)
from kvserve.runtime.tp.executor import TensorParallelExecutor
from kvserve.runtime.tp.group_check import publish_identity, refusal

ARGS_VAR = "KVSERVE_ENGINE_ARGS"
STARTUP_TIMEOUT_S = 300.0
NUM_BLOCKS_KEY = "kvserve/num_blocks"
READY_KEY = "kvserve/ready/{rank}"
# A beat every 0.2 s; this long without one is a lost rank, not a busy machine or network.
STALE_HEARTBEAT_S = 25 * HEARTBEAT_INTERVAL_S


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet and which of them this node runs."""

    master_addr: str
    master_port: int
    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    launched: bool = False  # torchrun started every rank: kvserve spawns none
    rank: int = 0  # this process's rank (torchrun's RANK; else 0)

    @classmethod
    def from_env(cls, world_size: int, nnodes: int = 1, node_rank: int = 0) -> Rendezvous:
        """torchrun's variables where set; else 127.0.0.1 and, on one node, a free port."""
        env = os.environ
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes), got {node_rank} of {nnodes}")
        if world_size % nnodes:
            raise ValueError(f"tensor_parallel_size {world_size} must be a multiple of "
                             f"--nnodes {nnodes} (the same number of ranks on every node)")
        launched = "RANK" in env and "WORLD_SIZE" in env
        if launched and (nnodes, node_rank) != (1, 0):
            raise ValueError("under torchrun, place the ranks with torchrun's own --nnodes and "
                             "--node-rank; drop kvserve's")
        if launched and int(env["WORLD_SIZE"]) != world_size:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but tensor_parallel_size is "
                             f"{world_size}; make them equal")
        if (nnodes > 1 or launched) and "MASTER_PORT" not in env:
            raise ValueError("several nodes (or torchrun) need MASTER_ADDR and MASTER_PORT set "
                             "to rank 0's address and a free port, the same on every node")
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else _free_port()
        return cls(env.get("MASTER_ADDR", "127.0.0.1"), port, world_size, nnodes, node_rank,
                   launched, int(env["RANK"]) if launched else 0)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def spawn_ranks(args: EngineArgs, rendezvous: Rendezvous,
                ranks: range) -> dict[int, subprocess.Popen[bytes]]:
    """Start `ranks` of this node as worker processes (their output goes to this stderr)."""
    payload = json.dumps(dataclasses.asdict(args))
    procs = {}
    for rank in ranks:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(rendezvous.world_size),
                   LOCAL_RANK=str(rank - rendezvous.node_rank * rendezvous.ranks_per_node),
                   MASTER_ADDR=rendezvous.master_addr, MASTER_PORT=str(rendezvous.master_port))
        env[ARGS_VAR] = payload
        procs[rank] = subprocess.Popen([sys.executable, "-m", "kvserve.runtime.tp.worker"],
                                       env=env, stdout=sys.stderr.fileno())
    return procs


class RankGroup:
    """Rank 0's side: the store, the local rank processes, and telling a failure's cause."""

    def __init__(self, args: EngineArgs, rendezvous: Rendezvous) -> None:
        if rendezvous.rank != 0:
            raise ValueError(f"this process is torchrun's rank {rendezvous.rank}: only rank 0 "
                             "builds the engine; launch `kvserve serve` under torchrun, whose "
                             "other ranks serve as workers")
        self.args = args
        self.rendezvous = rendezvous
        # torchrun's agent already serves a store at MASTER_PORT: join it instead.
        joins = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = TCPStore(rendezvous.master_addr, rendezvous.master_port,
                              rendezvous.world_size, is_master=not joins,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        spawn = range(1, 1 if rendezvous.launched else rendezvous.ranks_per_node)
        publish_identity(self.store, args)
        self.procs = spawn_ranks(args, rendezvous, spawn)
        # Ranks this process did not start (other nodes', torchrun's): lost = stopped beating.
        self.remote_ranks = [r for r in range(1, rendezvous.world_size) if r not in self.procs]
        self.beats = HeartbeatReader(self.store)
        self._next_beat_check = 0.0
        self.comm: Communicator | None = None

    def connect(self, runner: ModelRunner, num_blocks: int, stats: CollectiveStats
                ) -> TensorParallelExecutor:
        """Publish the pool size, wait for every rank to load, open the groups; the executor."""
        self.store.set(NUM_BLOCKS_KEY, str(num_blocks))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(range(1, self.rendezvous.world_size))
        while waiting:
            waiting = {r for r in waiting if not self.store.check([READY_KEY.format(rank=r)])}
            refused = refusal(self.store)
            if refused is not None:
                self.stop()
                raise TensorParallelError(refused)
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self.stop()
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited with code "
                                              f"{proc.returncode} while starting (its log is "
                                              "above)")
            if time.monotonic() > deadline:
                self.stop()
                raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not "
                                          f"start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        comm = Communicator(self.store, 0, self.rendezvous.world_size,
                            timeout_s=self.args.collective_timeout_s, device=runner.device,
                            stats=stats, diagnose=self.diagnose)
        self.comm = comm
        runner.model.set_all_reduce(comm.all_reduce)
        return TensorParallelExecutor(runner, comm, stats, self)

    def diagnose(self, op: str, exc: BaseException) -> tuple[CollectiveErrorKind, int | None, str]:
        """Which rank caused `op` to fail, from the rank processes and their heartbeats."""
        kind = classify(exc)
        # A killed process closes its sockets before it is reaped; a rank this process did not
        # start shows as lost only once its heartbeat goes stale (after a timeout too: its
        # node may be gone).
        wait_s = 1.0 if kind is not CollectiveErrorKind.TIMEOUT else 0.0
        if self.remote_ranks:
            wait_s = STALE_HEARTBEAT_S + 1.0
        deadline = time.monotonic() + wait_s
        lost = self.lost_rank()
        while lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
            lost = self.lost_rank()
        if lost is not None:
            return CollectiveErrorKind.RANK_LOST, lost[0], lost[1]
        step_id = self.comm.step_id if self.comm is not None else 0
        beats = {r: self.beats.read(r) for r in range(1, self.rendezvous.world_size)}
        for rank, beat in beats.items():
            if beat is None or beat[2] > STALE_HEARTBEAT_S:
                age = "never" if beat is None else f"{beat[2]:.1f} s ago"
                return (CollectiveErrorKind.RANK_LOST, rank,
                        f"rank {rank} stopped beating (last heartbeat {age})")
        if kind is CollectiveErrorKind.TIMEOUT:
            for rank, beat in beats.items():
                assert beat is not None
                beat_step, phase, _ = beat
                if beat_step < step_id or phase == "compute":
                    return (kind, rank, f"rank {rank} is still in {phase} of step {beat_step} "
                            f"after the others waited {self.args.collective_timeout_s:g} s in "
                            f"{op}: a slow or stalled rank")
        return kind, None, str(exc).splitlines()[0][:300]

    def lost_rank(self) -> tuple[int, str] | None:
        """(rank, what happened) of the first rank found gone: a local rank process that has
        exited, or (read at most every heartbeat interval) a remote rank that stopped beating."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return rank, f"rank {rank}'s process exited with code {proc.returncode}"
        now = time.monotonic()
        if not self.remote_ranks or now < self._next_beat_check:
            return None
        self._next_beat_check = now + HEARTBEAT_INTERVAL_S
        for rank in self.remote_ranks:
            beat = self.beats.read(rank)
            if beat is not None and beat[2] > STALE_HEARTBEAT_S:
                return rank, (f"rank {rank} stopped beating (last heartbeat {beat[2]:.1f} s "
                              "ago): its process or node is gone")
        return None

    def stop(self) -> None:
        """End this node's rank processes: they exit on their own after a clean close; after a
        failure they may be stuck (a stalled rank), so they are killed (they ignore SIGTERM:
        tp_worker.leave_stopping_to_rank_0)."""
        if self.comm is None or self.comm.failed:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_node(args: EngineArgs, rendezvous: Rendezvous) -> int:
    """A node other than rank 0's: start its ranks and wait; the first failure's exit code.
    Stopped (Ctrl-C, a signal), it exits and its ranks follow (tp_worker.exit_with_parent)."""
    procs = spawn_ranks(args, rendezvous, rendezvous.local_ranks())
    try:
        codes = [proc.wait() for proc in procs.values()]
    except KeyboardInterrupt:
        return 130
    return next((c for c in codes if c), 0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
