"""Serving planner (`llmopt plan serve`): KV capacity, max batch, TTFT, ITL and output tokens/s
of a continuous-batching deployment from FLOPs, HBM bandwidth and TP all-reduces, and a search
over TP/EP/replicas for a latency target. See `estimate` for the batching model."""

from llmopt.plan.serve.capacity import Capacity, capacity, kv_bytes_per_token
from llmopt.plan.serve.estimate import estimate
from llmopt.plan.serve.result import ServeEstimate
from llmopt.plan.serve.scenario import Load, Scenario, ServeInputError, parse_load

__all__ = [
    "Capacity",
    "Load",
    "Scenario",
    "ServeEstimate",
    "ServeInputError",
    "capacity",
    "estimate",
    "kv_bytes_per_token",
    "parse_load",
]
