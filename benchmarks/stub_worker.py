"""An OpenAI-compatible stand-in worker that does no model work, for measuring a router alone.

`python -m benchmarks.stub_worker --port P [--tokens N] [--token-interval S]
[--first-token-delay D]` answers:
- `POST /v1/completions` and `/v1/chat/completions`: streamed (`"stream": true`) as N SSE chunks
  S seconds apart (a decode step; each chunk its own write, as a worker sends them), a usage
  chunk and `[DONE]`; otherwise one JSON body. The first token comes D seconds after the
  request (a prefill; a streamed answer's headers go first, as vLLM sends them). It ignores
  every timeout header, as vLLM and SGLang do;
- `GET /health`, `GET /v1/models` (root "stub": no tokenizer to find) and `GET /metrics`: the
  vLLM-named series a router scrapes, with an idle queue and a 16,384-token cache.

Nothing here waits on compute, so whatever CPU a router spends per request behind it is the
router's own (`python -m benchmarks router-cpu`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import with_repo_on_path
from kvserve.bench.server_launch import ManagedProcess

METRICS = "".join(f"# TYPE {name} {kind}\n{name}{{model_name=\"stub\"}} {value}\n" for name, kind,
                  value in (("vllm:num_requests_running", "gauge", 0.0),
                            ("vllm:num_requests_waiting", "gauge", 0.0),
                            ("vllm:kv_cache_usage_perc", "gauge", 0.0),
                            ("vllm:prefix_cache_queries_total", "counter", 0.0),
                            ("vllm:prefix_cache_hits_total", "counter", 0.0)))
METRICS += ("# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0\n')
MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model",
                                                  "root": "stub", "owned_by": "kvserve"}]})


def _event(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked request body (Envoy sends one when a filter rewrote the body)."""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers: the empty line
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def _frame(chunk: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(chunk), chunk)


class StubServer:
    """Serves connections (keep-alive) with `tokens` output tokens a completion."""

    def __init__(self, tokens: int, token_interval_s: float,
                 first_token_delay_s: float = 0.0) -> None:
        self.tokens = tokens
        self.token_interval_s = token_interval_s
        self.first_token_delay_s = first_token_delay_s

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError,
                                 asyncio.LimitOverrunError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length = next((int(line.split(b":", 1)[1]) for line in lines[1:]
                               if line.lower().startswith(b"content-length:")), 0)
                chunked = any(line.lower().startswith(b"transfer-encoding:")
                              and b"chunked" in line.lower() for line in lines[1:])
                body = (await _read_chunked(reader) if chunked
                        else await reader.readexactly(length) if length else b"")
                if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
                    await self._complete(writer, path, body)
                else:
                    self._plain(writer, path)
                await writer.drain()
        writer.close()

    def _plain(self, writer: asyncio.StreamWriter, path: bytes) -> None:
        text, status = {b"/health": ("ok", 200), b"/metrics": (METRICS, 200),
                        b"/v1/models": (MODELS, 200)}.get(path, ("not found", 404))
        data = text.encode()
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(data), data))

    async def _complete(self, writer: asyncio.StreamWriter, path: bytes, raw: bytes) -> None:
        try:
            request = json.loads(raw)
            prompt_tokens = len(str(request.get("prompt", request.get("messages", "")))) // 4
        except ValueError:
            writer.write(b"HTTP/1.1 400 X\r\nContent-Length: 0\r\n\r\n")
            return
        chat = path == b"/v1/chat/completions"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": self.tokens,
                 "total_tokens": prompt_tokens + self.tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not request.get("stream"):
            await asyncio.sleep(self.first_token_delay_s)
            choice = ({"index": 0, "message": {"role": "assistant", "content": " x" * self.tokens},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": " x" * self.tokens, "finish_reason": "length"})
            data = json.dumps({"id": "stub", "object": "text_completion", "model": "stub",
                               "choices": [choice], "usage": usage}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(self.first_token_delay_s)
        for i in range(self.tokens):
            delta = {"delta": {"content": " x"}} if chat else {"text": " x"}
            writer.write(_frame(_event({"id": "stub", "model": "stub", "choices": [
                {"index": 0, **delta, "finish_reason": "length" if i == self.tokens - 1
                 else None}]})))
            await writer.drain()
            await asyncio.sleep(self.token_interval_s)
        writer.write(_frame(_event({"id": "stub", "model": "stub", "choices": [],
                                    "usage": usage})) + _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def _serve(port: int, tokens: int, token_interval_s: float,
                 first_token_delay_s: float) -> None:
    server = await asyncio.start_server(
        StubServer(tokens, token_interval_s, first_token_delay_s).handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class StubWorker(ManagedProcess):
    """One stub worker process."""

    def __init__(self, index: int, tokens: int, token_interval_s: float, log_dir: Path,
                 first_token_delay_s: float = 0.0) -> None:
        super().__init__(f"stub-worker-{index}", log_dir, startup_timeout_s=30.0)
        self.tokens = tokens
        self.token_interval_s = token_interval_s
        self.first_token_delay_s = first_token_delay_s

    def command(self) -> tuple[list[str], dict[str, str]]:
        return ([sys.executable, "-m", "benchmarks.stub_worker", "--port", str(self.port),
                 "--tokens", str(self.tokens), "--token-interval", str(self.token_interval_s),
                 "--first-token-delay", str(self.first_token_delay_s)],
                with_repo_on_path(os.environ))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stub_worker",
                                description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="output tokens a completion")
    p.add_argument("--token-interval", type=float, default=0.005,
                   help="seconds between two streamed tokens")
    p.add_argument("--first-token-delay", type=float, default=0.0,
                   help="seconds from a request to its first token")
    args = p.parse_args(argv)
    if args.tokens < 1 or not 0 <= args.token_interval <= 10 \
            or not 0 <= args.first_token_delay <= 600:
        p.error("--tokens must be >= 1, --token-interval within 0-10 s and "
                "--first-token-delay within 0-600 s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.port, args.tokens, args.token_interval,
                           args.first_token_delay))


if __name__ == "__main__":
    main()
