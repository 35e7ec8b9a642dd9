"""Continuous batching over a paged KV cache: the one decode loop (`generate`, speculative
decoding and `llmopt serve` all run it)."""

from llmopt.infer.batch.engine import EngineConfig, ServingEngine
from llmopt.infer.batch.request import StepOutput
from llmopt.infer.sampling import InvalidRequestError, SamplingParams

__all__ = ["ServingEngine", "EngineConfig", "InvalidRequestError", "SamplingParams", "StepOutput"]
