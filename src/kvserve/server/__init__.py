"""kvserve.server — the OpenAI-compatible worker over the AsyncEngine (FastAPI/uvicorn).

`create_app` loads lazily, so importing `kvserve.server.command` (every `kvserve` command does,
to build its parser) does not import torch and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from kvserve.server.app import create_app

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kvserve.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
