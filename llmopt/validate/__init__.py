"""llmopt.validate: the planners checked against published measurements.

`planner_runs` predicts published training runs (split into calibration rows, which cost terms
may be tuned on, and validation rows from other sources, which are only predicted);
`serving_runs` predicts published serving measurements; `cells` reads the sources' free-text
cells; `stats` is the one error summary. The data (with a source and locator per row) is in
`llmopt/validate/data/`. The scripts in `benchmarks/` are thin command lines over these.
"""
