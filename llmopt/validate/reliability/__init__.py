"""The reliability sweep: bad and edge-case inputs run through the real CLI, each outcome
classified (clean, vague, traceback, silent, data lost, hang). The catalogue is `cases.CASES`,
the runner `sweep`; CI's quick tier runs `sweep.sample()` (tests/house/test_reliability_inputs.py),
`benchmarks/reliability_sweep.py` the whole list (docs/reliability.md)."""

from llmopt.validate.reliability.cases import CASES, Case
from llmopt.validate.reliability.sweep import OUTCOMES, classify, run_case, run_cases, sample, table

__all__ = ["CASES", "OUTCOMES", "Case", "classify", "run_case", "run_cases", "sample", "table"]
