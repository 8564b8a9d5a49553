"""kvserve.runtime — the engine joined to the model: LLMEngine, AsyncEngine and the offline LLM."""

from kvserve.runtime.async_engine import AsyncEngine, EngineDeadError
from kvserve.runtime.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from kvserve.runtime.engine_args import EngineArgs
from kvserve.runtime.llm import LLM
from kvserve.runtime.llm_engine import EngineStats, LLMEngine
from kvserve.runtime.outputs import CompletionOutput, RequestOutput

__all__ = [
    "DEMO_MODEL_NAME",
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "ensure_demo_model",
]
