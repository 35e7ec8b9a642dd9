"""Continuous batching over a paged KV cache (the serving engine behind `llmopt serve`)."""

from llmopt.infer.batch.engine import Engine, EngineConfig
from llmopt.infer.batch.request import InvalidRequestError, SamplingParams, StepOutput

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "SamplingParams", "StepOutput"]
