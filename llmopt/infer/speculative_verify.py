"""Transition alias of `llmopt.infer.speculative.verify`, for `infer/batch/engine.py` alone.

The speculative modules became the package `llmopt.infer.speculative`; engine.py is being
changed elsewhere, so its two imports move there and then this file goes (with its twin
`speculative_stats.py`).
"""

from llmopt.infer.speculative.verify import verify_greedy, verify_sampled

__all__ = ["verify_greedy", "verify_sampled"]
