"""Speculative decoding: a cheap draft guesses γ tokens, the target checks them in one pass.

The public API, one concept per module:
- `loop`: the draft-and-verify loop (`speculative_generate`, `SpeculativeConfig`);
- `verify`: the acceptance rules that make the output exact (greedy: the target's
  greedy output; sampling: Leviathan/Chen rejection sampling, the target's distribution);
- `stats`: acceptance counters and timings of a run;
- `predict`: the speed model, the one speedup predictor and the optimal γ;
- `measure`: pass-cost calibration and the measured plain-vs-speculative
  comparison (`compare_with_plain`);
- `cli`: the `llmopt generate --draft` flags.
Drafts live in `llmopt.infer.drafts`.
"""

from __future__ import annotations

from llmopt.infer.drafts import SpeculativeConfig
from llmopt.infer.speculative.cli import add_speculative_arguments, run_speculative_from_args
from llmopt.infer.speculative.loop import SpeculativeResult, speculative_generate
from llmopt.infer.speculative.measure import (
    Comparison,
    PlainRun,
    Timing,
    calibrate,
    calibrate_costs,
    compare_with_plain,
    costs_from_times,
    measure_plain,
    time_passes,
)
from llmopt.infer.speculative.predict import (
    PassCosts,
    expected_tokens_per_round,
    optimal_gamma,
    predicted_speedup,
)
from llmopt.infer.speculative.stats import SpeculativeStats
from llmopt.infer.speculative.verify import verify_greedy, verify_sampled

__all__ = [
    "Comparison",
    "PassCosts",
    "PlainRun",
    "SpeculativeConfig",
    "SpeculativeResult",
    "SpeculativeStats",
    "Timing",
    "add_speculative_arguments",
    "calibrate",
    "calibrate_costs",
    "compare_with_plain",
    "costs_from_times",
    "expected_tokens_per_round",
    "measure_plain",
    "optimal_gamma",
    "predicted_speedup",
    "run_speculative_from_args",
    "speculative_generate",
    "time_passes",
    "verify_greedy",
    "verify_sampled",
]
