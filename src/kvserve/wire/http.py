"""The HTTP wire between kvserve's gateway (proxy or Endpoint Picker) and its workers: header
names, the routes the gateway proxies, and the OpenAI-style error body both sides answer with.
Header names are lower-case (HTTP compares them case-insensitively; ASGI and Envoy hand them
over lower-cased)."""

from __future__ import annotations

import json

PREFILL_URL_HEADER = "x-kvserve-prefill-url"
"""Sent by the gateway to a decode worker: the prefill worker to pull the prompt's KV from
(honoured only with ADMIN_KEY_HEADER)."""

ADMIN_KEY_HEADER = "x-kvserve-admin-key"
"""The workers' admin key (`--admin-key`), proving a request is the gateway's."""

SALT_KEY_HEADER = "x-kvserve-salt-key"
"""The workers' `--trusted-salt-key`: proves a request's `cache_salt` is the gateway's."""

TENANT_HEADER = "x-tenant-id"
"""The tenant the gateway resolved, sent to workers (and, behind a trusted layer, read from
clients: `--trust-tenant-header`)."""

PREDICTED_CACHED_HEADER = "x-kvserve-predicted-cached-tokens"
"""On each answer the gateway relays: the prompt tokens the policy expected the worker to have
cached, so a client can check the routing's prediction against the worker's
`usage.prompt_tokens_details.cached_tokens`. It says only what the caller's own tenant caches:
tenant salts keep tenants' blocks apart."""

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
PROXIED_PATHS = frozenset({COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH})
"""The routes the gateway routes by prefix (the rest it answers itself or does not serve)."""


def error_body(status: int, message: str, err_type: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error object, as the OpenAI SDKs parse it."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None,
                                 "code": status}}).encode()
