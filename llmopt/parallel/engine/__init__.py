"""The training engine: `parallelize(model, grid, plan) -> TrainingEngine` (`core`), what it refuses
(`checks`) and its checkpoint state (`state`)."""

from llmopt.parallel.engine.checks import DTYPES, EngineError
from llmopt.parallel.engine.core import TrainingEngine, TrainStepOutput, parallelize
from llmopt.parallel.engine.state import BUFFER
from llmopt.parallel.loss import Objective

__all__ = [
    "BUFFER",
    "DTYPES",
    "TrainingEngine",
    "EngineError",
    "Objective",
    "TrainStepOutput",
    "parallelize",
]
