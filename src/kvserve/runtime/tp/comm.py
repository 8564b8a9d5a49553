"""The tensor-parallel group's transport: timed collectives, a watchdog timeout, named failures.

Two process groups over one TCP store: the model group (all_reduce in every layer, the step
check's all_gather) runs with the collective timeout, so a collective that does not finish in
time raises instead of hanging; the control group (rank 0 broadcasting each step's plan) has
no practical timeout, because the other ranks wait on it whenever the server is idle. Every
collective is timed into `CollectiveStats`; a failure is classified (timeout, rank lost,
backend error), counted, and raised as `CollectiveError` naming the op, the step and, where
the heartbeats tell, the rank at fault. Ranks other than 0 post a heartbeat (step, phase) to
the store, which is how rank 0 tells a slow rank from a dead one.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

from kvserve.runtime.collective_stats import CollectiveErrorKind, CollectiveStats

CONTROL_TIMEOUT = timedelta(days=365)  # ranks wait for the next step as long as the server idles
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_KEY = "kvserve/heartbeat/{rank}"


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot go on: the worker fails its requests and exits."""


class CollectiveError(TensorParallelError):
    """A collective failed; `rank` is the rank found at fault (None: not known)."""

    def __init__(self, op: str, kind: CollectiveErrorKind, step_id: int, rank: int | None,
                 detail: str) -> None:
        self.op, self.kind, self.step_id, self.rank = op, kind, step_id, rank
        who = f"rank {rank}" if rank is not None else "an unknown rank"
        super().__init__(f"tensor-parallel {op} failed at step {step_id} ({kind.value}, "
                         f"{who}): {detail}")


class RankDivergenceError(TensorParallelError):
    """A rank was about to execute another step or another KV layout than rank 0 sent."""

    def __init__(self, rank: int, step_id: int, got_step_id: int, checksum: int,
                 got_checksum: int) -> None:
        self.rank, self.step_id = rank, step_id
        super().__init__(f"tensor-parallel rank {rank} diverged at step {step_id}: it holds "
                         f"step {got_step_id} with block-table checksum {got_checksum:#x}, "
                         f"rank 0 sent checksum {checksum:#x}; the step was not run")


# Called on rank 0 with (op, the backend's exception) -> (kind, rank at fault, detail).
Diagnose = Callable[[str, BaseException], tuple[CollectiveErrorKind, int | None, str]]


class Communicator:
    """One rank's view of the group. Not thread-safe: the step loop (or the worker loop) owns
    it. `phase` and `step_id` are what the heartbeat reports."""

    def __init__(self, store: Store, rank: int, world_size: int, *, timeout_s: float,
                 device: torch.device, stats: CollectiveStats | None = None,
                 diagnose: Diagnose | None = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.stats = stats
        self.diagnose = diagnose
        timeout = timedelta(seconds=timeout_s)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.model_group = _process_group(PrefixStore("kvserve/model", store), rank, world_size,
                                          timeout, device)
        self.control_group = ProcessGroupGloo(PrefixStore("kvserve/control", store), rank,
                                              world_size, CONTROL_TIMEOUT)
        self.step_id = 0
        self.phase = "idle"
        self.wait_s = 0.0  # seconds inside collectives since `reset_wait`
        self.failed = False

    def reset_wait(self) -> None:
        self.wait_s = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self._run("all_reduce", lambda: self.model_group.allreduce([tensor]), self.backend)
        return tensor

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), by rank."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run("all_gather", lambda: self.model_group.allgather([out], [mine]), self.backend)
        return [t.tolist() for t in out]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (pickled; others pass None) on every rank, via the control group."""
        size = torch.zeros(1, dtype=torch.int64)
        payload = b""
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(payload)
        self._run("broadcast", lambda: self.control_group.broadcast(size, 0), "gloo")
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                else torch.empty(int(size[0]), dtype=torch.uint8))
        self._run("broadcast", lambda: self.control_group.broadcast(data, 0), "gloo")
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _run(self, op: str, start: Callable[[], Any], backend: str) -> None:
        """Start the collective, wait for it, time it; a failure becomes CollectiveError."""
        self.phase = op
        begin = time.perf_counter()
        try:
            start().wait()
            if backend == "nccl":
                torch.cuda.current_stream().synchronize()  # NCCL's wait only orders streams
        except RuntimeError as exc:
            self.failed = True
            raise self._failure(op, exc) from exc
        finally:
            self.phase = "compute"
        elapsed = time.perf_counter() - begin
        self.wait_s += elapsed
        if self.stats is not None:
            self.stats.observe(op, backend, elapsed)

    def _failure(self, op: str, exc: BaseException) -> CollectiveError:
        if self.diagnose is not None:
            kind, rank, detail = self.diagnose(op, exc)
        else:
            kind, rank, detail = classify(exc), None, str(exc).splitlines()[0][:300]
        if self.stats is not None:
            self.stats.error(op, kind)
        return CollectiveError(op, kind, self.step_id, rank, detail)


def classify(exc: BaseException) -> CollectiveErrorKind:
    """The kind of a backend exception, from what gloo and NCCL say."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return CollectiveErrorKind.TIMEOUT
    if "closed by peer" in text or "connection reset" in text or "broken pipe" in text:
        return CollectiveErrorKind.RANK_LOST
    return CollectiveErrorKind.BACKEND_ERROR


def _process_group(store: Store, rank: int, world_size: int, timeout: timedelta,
                   device: torch.device) -> Any:
    """gloo on CPU; NCCL for CUDA tensors (its timeout set the same way)."""
    if device.type != "cuda":
        return ProcessGroupGloo(store, rank, world_size, timeout)
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, options)


class Heartbeat:
    """Posts this rank's (step, phase, time) to the store every HEARTBEAT_INTERVAL_S from a
    daemon thread with its own store connection, so it keeps beating while the rank computes
    (or sleeps) and stops only when the process is gone."""

    def __init__(self, host: str, port: int, comm: Communicator) -> None:
        self._store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._comm = comm
        self._thread = threading.Thread(target=self._beat, name="kvserve-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = HEARTBEAT_KEY.format(rank=self._comm.rank)
        while True:
            self._store.set(key, f"{self._comm.step_id} {self._comm.phase} {time.time():.3f}")
            time.sleep(HEARTBEAT_INTERVAL_S)


class HeartbeatReader:
    """Rank 0's reading of the other ranks' heartbeats. A beat's age is how long its value has
    stayed unchanged by this process's clock, not its stamp: a rank on another node stamps with
    its own clock, which may be seconds off."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (beat, monotonic first seen)

    def read(self, rank: int) -> tuple[int, str, float] | None:
        """(step id, phase, seconds the beat has not changed) of `rank`; None if it never beat."""
        key = HEARTBEAT_KEY.format(rank=rank)
        if not self._store.check([key]):
            return None
        beat, now = self._store.get(key), time.monotonic()
        seen = self._seen.get(rank)
        if seen is None or seen[0] != beat:
            seen = self._seen[rank] = (beat, now)
        step, phase, _ = beat.decode().split()
        return int(step), phase, now - seen[1]
