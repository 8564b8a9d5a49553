"""AsyncEngine: the step loop on its own thread, per-request async streams, cancellation.

The engine is not thread-safe, so every mutation (add, abort) is queued to the loop thread and
applied between steps: an abort that arrives during a step takes effect right after it. A stream
that is closed early (client disconnect, task cancelled) aborts its request, which frees its
blocks through the engine's one free path.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.engine import SamplingParams
from kvserve.model.openmp_pool import release_calling_thread_pool
from kvserve.runtime.engine_info import EngineInfo
from kvserve.runtime.llm_engine import EngineStats, LLMEngine
from kvserve.runtime.lora_registry import LoRARegistry
from kvserve.runtime.outputs import RequestOutput

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; the server reports it on /health."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Runs `engine` on a background thread; `generate` streams its outputs to asyncio."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        # What the server reads about the engine: fixed at load, or thread-safe.
        self.info: EngineInfo = engine.info
        self.tokenizer = engine.tokenizer
        self.kv_events = engine.kv_events  # the cache's events (/kv/events, ZMQ)
        self.collective_stats = engine.collective_stats  # tensor parallelism only (locked)
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    def start(self) -> AsyncEngine:
        """Start the step loop; the calling thread (which loaded the model) gives up its
        OpenMP pool, so the loop's thread runs parallel regions as the offline engine does
        (model/openmp_pool.py)."""
        release_calling_thread_pool()
        self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    @property
    def lora(self) -> LoRARegistry | None:
        """The engine's LoRA adapters (None without enable_lora): names, digests, slots."""
        return self.engine.lora

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs step by step until it finishes.

        Raises ValueError before the first output if the engine refuses the request. Closing
        the iterator early aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: Future[None] = Future()

        def add() -> None:
            # The caller may have left while this waited for the engine thread: then there
            # is nobody to stream to (and setting a cancelled future's result would raise here,
            # killing the engine thread).
            if not accepted.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(request_id, prompt, params, **kwargs)
            except BaseException as exc:
                accepted.set_exception(exc)
                return
            self._streams[request_id] = stream
            accepted.set_result(None)

        self._submit(add)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the engine may have taken it just before the caller left
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine's thread between steps (e.g. an audit) and return
        its result; the engine is never read while a step mutates it."""
        return await asyncio.wrap_future(self.submit_call(fn))

    def submit_call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Queue `fn(engine)` for the engine's thread now (commands run in submission order)
        and return its future; for callers that must fix the order before they await."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        result: Future[T] = Future()

        def run() -> None:
            if not result.set_running_or_notify_cancel():
                return  # the caller left before the engine thread got to it
            try:
                result.set_result(fn(self.engine))
            except BaseException as exc:
                result.set_exception(exc)

        self._submit(run)
        return result

    def run_soon(self, fn: Callable[[LLMEngine], object]) -> None:
        """Queue `fn(engine)` for the engine's thread and do not wait (safe from a cancelled
        task's cleanup); its result is dropped, an exception is logged by the loop."""
        self._submit(lambda: self._run_quietly(fn))

    def _run_quietly(self, fn: Callable[[LLMEngine], object]) -> None:
        try:
            fn(self.engine)
        except Exception:
            logging.getLogger(__name__).exception("engine command failed")

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; applied right after the current step."""
        def apply() -> None:
            self.engine.abort(request_id)

        self._submit(apply)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the loop, after waiting up to `drain_timeout_s` for live requests to finish;
        what is still live then is aborted."""
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.is_running:
            time.sleep(0.01)
        for request_id in list(self._streams):
            self.abort(request_id)
        end = time.monotonic() + 5.0
        while self._streams and time.monotonic() < end and self.is_running:
            time.sleep(0.01)
        self._stop = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    # -- the loop thread ------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished:
                    self.engine.check_ranks()  # a lost rank fails the worker even when idle
                    self.stats = self.engine.stats()
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                self.stats = self.engine.stats()
                for output in outputs:
                    self._deliver(output)
        except BaseException as exc:  # the loop must never die silently
            self.error = exc
            failure = EngineDeadError(f"engine loop failed: {exc!r}")
            for request_id in list(self._streams):
                self._deliver_error(request_id, failure)
            self._release_all(str(failure))
            raise

    def _release_all(self, error: str) -> None:
        """After the loop died: end every request so no block stays held, publish the stats
        that show it, stop any other tensor-parallel ranks."""
        try:
            self.engine.fail_all(error)
            self.stats = self.engine.stats()
        except Exception:
            logging.getLogger(__name__).exception("could not release the requests' blocks")
        self.engine.close()

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            command()

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        # The engine keeps mutating its own output object; the stream gets a frozen copy.
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output.snapshot())

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
