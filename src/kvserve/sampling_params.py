"""vLLM's `vllm.sampling_params` names, so `from kvserve.sampling_params import
StructuredOutputsParams` reads as a vLLM script's import does."""

from kvserve.engine import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]
