"""From an OpenAI request body to what the routing policy sees (`RouteRequest`)."""

from __future__ import annotations

from typing import Any

from kvserve.gateway.core.adapters import RequestAdapter
from kvserve.gateway.core.pipeline import RouteRequest
from kvserve.gateway.core.prefix import DEFAULT_BLOCK_TOKENS, RouteKey
from kvserve.gateway.core.token_keys import TokenKeyer


def route_request_for(path: str, body: dict[str, Any], salt: str | None,
                      keyer: TokenKeyer | None = None,
                      adapter: RequestAdapter | None = None) -> RouteRequest:
    """Key a request by its prompt (completions) or its canonical messages and tools (chat),
    salted with the tenant's cache salt and keyed by its LoRA `adapter` (None: the base model).
    With `keyer` (the workers' tokenizer), a text prompt is keyed by its token ids exactly as a
    kvserve worker hashes them, and so is a token-id prompt and, when the model has a chat
    template, a conversation (model id from the body's "model", or the adapter's base model;
    the adapter by its digest; the keyer's block size). Raises ValueError for a body with no
    prompt."""
    model_id = adapter.base_model if adapter is not None else str(body.get("model") or "")
    name = adapter.name if adapter is not None else None
    block = keyer.block_size if keyer is not None else DEFAULT_BLOCK_TOKENS

    def exact(token_ids: list[int]) -> RouteRequest:
        return RouteRequest.from_key(RouteKey.from_token_ids(
            token_ids, salt, block_tokens=block, model_id=model_id,
            adapter_digest=adapter.digest if adapter is not None else None, adapter=name))

    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("'messages' must be a list of message objects")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be a list")
        if keyer is not None:
            ids = keyer.encode_chat(messages, tools, body.get("add_generation_prompt") is not False)
            if ids:
                return exact(ids)
        return RouteRequest.from_key(RouteKey.from_messages(messages, salt, tools=tools,
                                                            adapter=name))
    prompt = body.get("prompt")

    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if keyer is not None:
            return exact(keyer.encode(prompt))
        return RouteRequest.from_key(RouteKey.from_text(prompt, salt, adapter=name))
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return exact(prompt)
        if isinstance(first, list):
            return exact(first)
    raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")
