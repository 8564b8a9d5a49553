"""From an OpenAI request body to what the routing policy sees (`RouteRequest`)."""

from __future__ import annotations

from typing import Any

from kvserve.gateway.policies import RouteRequest
from kvserve.gateway.prefix import RouteKey


def route_request_for(path: str, body: dict[str, Any], salt: str | None) -> RouteRequest:
    """Key a request by its prompt (completions) or its canonical messages and tools (chat),
    salted with the tenant's cache salt. Raises ValueError for a body with no prompt."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("'messages' must be a list of message objects")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be a list")
        return RouteRequest.from_key(RouteKey.from_messages(messages, salt, tools=tools))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return RouteRequest.from_key(RouteKey.from_text(prompt, salt))
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return RouteRequest.from_key(RouteKey.from_text(first, salt))
        if isinstance(first, int):
            return RouteRequest.from_key(RouteKey.from_token_ids(prompt, salt))
        if isinstance(first, list):
            return RouteRequest.from_key(RouteKey.from_token_ids(first, salt))
    raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")
