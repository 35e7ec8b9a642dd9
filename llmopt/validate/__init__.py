"""Validation of llmopt against references and its own promises (the checks benchmarks and
tests share): each module defines one check once.

`planner_runs` predicts published training runs (split into calibration rows, which cost terms
may be tuned on, and validation rows from other sources, which are only predicted);
`mappings` ranks frameworks' published mappings inside the planner's search; `serving_runs`
predicts published serving measurements; `planner_engine` and `crosscheck` are the
planner's and the engine's sides of the planner-vs-engine crosscheck; `pipeline_measure` measures
pipeline bubbles and saved activation bytes; `cells` reads the sources' free-text cells; `stats` is
the one error summary; `reliability` is the bad-input sweep. The published-run data (with a
source and locator per row) is in `llmopt/validate/data/`.
"""
