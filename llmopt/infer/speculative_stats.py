"""Transition alias of `llmopt.infer.speculative.stats`, for `infer/batch/engine.py` alone.

The speculative modules became the package `llmopt.infer.speculative`; engine.py is being
changed elsewhere, so its two imports move there and then this file goes (with its twin
`speculative_verify.py`).
"""

from llmopt.infer.speculative.stats import SpeculativeStats

__all__ = ["SpeculativeStats"]
