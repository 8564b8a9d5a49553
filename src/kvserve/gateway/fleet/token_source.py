"""Where the gateway's exact token keys come from: a tokenizer path given, or the first worker
whose /v1/models names a local model directory. The one part of keying that reads workers."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvserve.gateway.core.token_keys import TokenKeyer


class ExactKeys:
    """The gateway's `TokenKeyer`, if it has one: from `tokenizer` (a path) when given; else,
    when `wanted` (the `precise` policy), from the first worker whose /v1/models names a local
    model directory ("root", as vLLM and kvserve report it). Without one, keys stay textual."""

    def __init__(self, tokenizer: str | None, block_size: int, wanted: bool) -> None:
        self.keyer = TokenKeyer(tokenizer, block_size) if tokenizer else None
        self.block_size = block_size
        self.wanted = wanted
        self.source = tokenizer

    async def resolve(self, client: httpx.AsyncClient, workers: list[str]) -> None:
        if self.keyer is not None or not self.wanted:
            return
        root = await workers_model_dir(client, workers)
        if root is not None:
            self.keyer = TokenKeyer(root, self.block_size)
            self.source = str(root)


async def workers_model_dir(client: httpx.AsyncClient, workers: list[str]) -> Path | None:
    """The first worker's model directory (/v1/models "root", as vLLM and kvserve report it)
    that is a local directory with a tokenizer.json; None when no worker names one."""
    for url in workers:
        try:
            resp = await client.get(f"{url}/v1/models", timeout=5.0)
            root = resp.json()["data"][0].get("root")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            continue
        if root and (Path(root) / "tokenizer.json").is_file():
            return Path(root)
    return None
