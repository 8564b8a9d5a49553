"""kvserve.server — the OpenAI-compatible worker over the AsyncEngine (FastAPI/uvicorn)."""

from kvserve.server.app import create_app
from kvserve.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
