"""OpenAI-shaped errors: 4xx for the caller's mistakes, 429/503 for load, 5xx only for our faults.

Every error body is `{"error": {"message", "type", "param", "code"}}` and its message says what to
change.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.runtime import EngineDeadError

logger = logging.getLogger("kvserve.server")


class APIError(Exception):
    """An error to return as OpenAI JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.headers = headers or {}


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON: send a JSON object (UTF-8)", None
    if param is None and first.get("type") == "value_error":
        return f"invalid request body: {first.get('msg')}", None
    if param is None:
        return f"invalid request body: {first.get('msg')}; send a JSON object", None
    return f"invalid value for '{param}': {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception type the server can meet to an OpenAI error response."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.err_type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        if exc.status_code == 404:
            detail = "no such route; see /v1/completions, /v1/chat/completions, /v1/models"
        elif exc.status_code == 400 and detail == "There was an error parsing the body":
            # FastAPI's words for a body json.loads refused (e.g. bytes that are not UTF-8).
            detail = "the request body is not valid JSON: send a JSON object (UTF-8)"
        return error_response(exc.status_code, detail, "invalid_request_error")

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"the engine is not running: {exc}", "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(500, "internal server error (our fault; see the server log)",
                              "internal_error")
