"""The planner's side of the planner-vs-engine crosscheck: what `llmopt.plan` predicts for a small
3D config (bytes and calls per process group and op, activation bytes per pipeline stage), in
the shape the engine's counted step reports (`llmopt.validate.crosscheck`), so the two
are compared key by key (tests/validate/test_pipeline_crosscheck.py, benchmarks/planner_vs_engine.py).
A case is a `CrosscheckCase` (its `ParallelPlan`, sequence length and tied embeddings).
"""

from __future__ import annotations

from llmopt.plan.predict import STAGES, predicted_activation_bytes, predicted_comm
from llmopt.validate.crosscheck import CrosscheckCase, crosscheck_model


def planner_prediction(case: CrosscheckCase) -> dict:
    """The planner's per-(group, op) bytes/calls and activation bytes, first and last stage
    (`llmopt.plan.predict`: the same numbers `llmopt plan --emit` writes into a run config)."""
    cfg, seq, plan = crosscheck_model(case.tied), case.seq, case.plan
    batch = plan.sequences_per_step()
    comm = {
        stage: {
            f"{group}/{op}": row
            for group, ops in predicted_comm(cfg, seq, batch, plan, stage).items()
            for op, row in ops.items()
        }
        for stage in STAGES
    }
    # Like with like: the planner's "eager" activation model (what this engine's autograd
    # saves, bf16 here), not the fused-kernel Korthikanti default.
    acts = {s: predicted_activation_bytes(cfg, seq, batch, plan, s) for s in STAGES}
    return {"comm": comm, "activations": acts}
