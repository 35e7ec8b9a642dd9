"""The planner's side of the planner-vs-engine crosscheck: what `llmopt.plan` predicts for a small
3D config (bytes and calls per process group and op, activation bytes per pipeline stage), in
the shape the engine's counted step reports (`llmopt.validate.crosscheck`), so the two
are compared key by key (tests/validate/test_pipeline_crosscheck.py, benchmarks/planner_vs_engine.py).
A case is a dict: tp, pp, sp, zero, m (micro-batches), schedule, v (virtual stages), rc
(recompute), and optionally tied, seq, mb.
"""

from __future__ import annotations

from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.predict import STAGES, predicted_activation_bytes, predicted_comm
from llmopt.validate.crosscheck import MB, SEQ, crosscheck_model


def planner_prediction(case: dict, dp: int) -> dict:
    """The planner's per-(group, op) bytes/calls and activation bytes, first and last stage
    (`llmopt.plan.predict`: the same numbers `llmopt plan --emit` writes into a run config)."""
    cfg = crosscheck_model(case.get("tied", False))
    seq, mb = case.get("seq", SEQ), case.get("mb", MB)
    plan = ParallelPlan(
        tp=case["tp"],
        pp=case["pp"],
        dp=dp,
        sequence_parallel=case["sp"],
        zero_stage=case["zero"],
        micro_batch=mb,
        num_microbatches=case["m"],
        schedule="interleaved" if case["v"] > 1 else case["schedule"],
        virtual_stages=case["v"],
        recompute=case["rc"],
    )
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
