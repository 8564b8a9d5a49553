"""ASGI middleware that runs before routing: request body size, request id echo.

Plain ASGI, not Starlette's BaseHTTPMiddleware: that one wraps `receive` in a task group, so
`Request.is_disconnected()` never sees the client leave and a dropped non-streaming request
would run to the end instead of being aborted.
"""

from __future__ import annotations

import contextlib
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """Answers 413 (OpenAI JSON) to a body over `max_bytes`, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0
        too_big = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, too_big
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_big = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns any error while reading the body into its own 400; once the body
            # is known to be too big, that answer is dropped and the 413 goes out instead.
            nonlocal started
            if too_big:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, limited_receive, guarded_send)
        if too_big and not started:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes; send a smaller request"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class EchoRequestId:
    """Copies the caller's X-Request-Id header onto the response (streamed or not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = None
        if scope["type"] == "http":
            request_id = dict(scope.get("headers", ())).get(b"x-request-id")
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
