"""The training engine: `parallelize(model, grid, plan) -> Engine` (`core`), what it refuses
(`checks`) and its checkpoint state (`state`)."""

from llmopt.parallel.engine.checks import DTYPES, EngineError
from llmopt.parallel.engine.core import Engine, StepOutput, parallelize
from llmopt.parallel.engine.state import BUFFER
from llmopt.parallel.loss import Objective

__all__ = ["BUFFER", "DTYPES", "Engine", "EngineError", "Objective", "StepOutput", "parallelize"]
