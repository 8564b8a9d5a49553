"""kvserve.engine — requests, sampling parameters, the scheduler and the engine step, in pure
Python (imports kvserve.kvcache only; no torch, numpy or HTTP)."""

from kvserve.engine.config import PreemptionMode, SchedulerConfig
from kvserve.engine.core import (
    EngineCore,
    ModelExecutor,
    PlannedStep,
    RequestDelta,
    SampledToken,
)
from kvserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from kvserve.engine.request import FinishReason, Request, RequestStatus, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.scheduler_output import ScheduledRequest, SchedulerCounts, SchedulerOutput
from kvserve.engine.structured import (
    GuidedDecodingParams,
    StructuredKind,
    StructuredOutput,
    StructuredOutputsParams,
)

__all__ = [
    "EngineCore",
    "FinishReason",
    "GuidedDecodingParams",
    "IncrementalDetokenizer",
    "ModelExecutor",
    "PlannedStep",
    "PreemptionMode",
    "Request",
    "RequestDelta",
    "RequestStatus",
    "SampledToken",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounts",
    "SchedulerOutput",
    "StructuredKind",
    "StructuredOutput",
    "StructuredOutputsParams",
    "TokenDecoder",
    "TokenLogprob",
]
