"""vLLM's utility routes: /tokenize, /detokenize (API key), /version and /ping (no key, as
vLLM: health probes carry none). Bodies and answers are shaped as vLLM 0.32's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

import kvserve
from kvserve.chat_template import open_final_message, template_argument
from kvserve.model import Tokenizer
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` (text) or `messages` (rendered by the chat template).
    `add_special_tokens` defaults to True for a prompt and False for messages (the template
    writes its own), as vLLM's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) and 'messages' (a chat)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def model_card(model_name: str, root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One /v1/models entry with vLLM's fields (`created`: when this server started)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "kvserve",
            "root": root, "parent": None, "max_model_len": max_model_len,
            "permission": [{
                "id": f"modelperm-{model_name}", "object": "model_permission",
                "created": created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None,
                "is_blocking": False}]}


def add_vllm_routes(app: FastAPI, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                    require_api_key: Callable[[Request], None]) -> None:
    """Register the routes on `app`; /tokenize and /detokenize need `require_api_key`."""

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{model_name!r} (see /v1/models)", param="model",
                           err_type="not_found_error")

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.prompt is not None:
            specials = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=specials)
        else:
            assert body.messages is not None
            chat = tokenizer
            if body.chat_template is not None:
                chat = tokenizer.with_chat_template(template_argument(body.chat_template))
            messages = [m.as_template_message() for m in body.messages]
            text = chat.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                **(body.chat_template_kwargs or {}))
            if body.continue_final_message:
                text = open_final_message(text, messages)
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        strs = None
        if body.return_token_strs:
            strs = [tokenizer.id_to_token(t) or "" for t in ids]
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size}); got "
                           f"{bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

