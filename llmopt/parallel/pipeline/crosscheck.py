"""Planner vs engine: the same config predicted by `llmopt.plan` and measured on the engine.

`engine_step(rank, world, case)` runs one optimizer step of a small 3D config on this rank
(inside an initialised gloo world) and returns its counted communication per (group, op) and
the peak bytes its transformer blocks saved for backward. `planner_prediction(case, dp)` gives
the planner's numbers for the first and the last pipeline stage, activations from the
planner's "eager" kernel mode (what this engine saves), not its fused-kernel default. Both use bf16 activations and
weights with fp32 gradient reduction (the planner's "megatron" numerics).

`case` keys: tp, pp, sp, zero, m (micro-batches), schedule, v, rc (recompute), and optionally
seq (sequence length), mb (micro-batch size) and tied (tied embeddings).
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.models import ModelConfig, build_model

SEQ, MB = 16, 2


def crosscheck_model(tied: bool = False) -> ModelConfig:
    """Small enough for CPU processes; every TP degree up to 4 and pp*v up to 4 divide it."""
    return ModelConfig(
        tie_embeddings=tied,
        name="xcheck",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=64,
    )


def _flat(counts: dict) -> dict[str, dict[str, int]]:
    return {
        f"{group}/{op}": {"calls": v["calls"], "bytes": v["bytes"]}
        for group, ops in counts.items()
        for op, v in ops.items()
    }


def engine_step(rank: int, world: int, case: dict) -> dict:
    """One optimizer step on this rank: counted communication and block activation peak."""
    from llmopt.parallel.comm import CommCounter
    from llmopt.parallel.grid import ParallelDims, RankGrid
    from llmopt.parallel.pipeline.measure import SavedTensorMeter
    from llmopt.parallel.pipeline.parallelize import PipelineConfig, build_pipeline_model

    cfg = crosscheck_model(case.get("tied", False))
    seq, mb = case.get("seq", SEQ), case.get("mb", MB)
    grid = RankGrid.create(ParallelDims(world, tp=case["tp"], pp=case["pp"]))
    pm = build_pipeline_model(
        build_model(cfg, seed=0),
        grid,
        PipelineConfig(case["schedule"], case["m"], case["v"]),
        zero=case["zero"],
        sequence_parallel=case["sp"],
        recompute=case["rc"],
        param_dtype=torch.bfloat16,
    )
    opt = torch.optim.AdamW(pm.master_params(), lr=1e-3)
    gen = torch.Generator().manual_seed(grid.dp.rank)
    data = torch.randint(0, cfg.vocab_size, (case["m"] * mb, seq + 1), generator=gen)
    exclude = list(pm.rank_module.parameters()) + [u.flat for u in pm.dp.units]
    before = grid.counter.snapshot()
    with SavedTensorMeter(exclude, only_inside=list(pm.rank_module.layers)) as meter:
        result = pm.forward_backward(data[:, :-1], data[:, 1:])
    pm.dp.clip_grad_norm_(1.0)
    opt.step()
    pm.dp.update_params()
    pm.dp.zero_grad()
    counts = CommCounter.delta(grid.counter.snapshot(), before)
    return {
        "coords": grid.dims.coords(rank),
        "comm": _flat(counts),
        "activation_peak_bytes": meter.peak,
        "layers": len(pm.rank_module.layers),
        "loss": pm.global_loss(result),
    }


def planner_prediction(case: dict, dp: int) -> dict:
    """The planner's per-(group, op) bytes/calls and activation bytes, first and last stage."""
    from llmopt.plan.comm import collectives_for, summarize
    from llmopt.plan.hardware import get_cluster
    from llmopt.plan.memory import (
        SCHED_1F1B,
        SCHED_GPIPE,
        SCHED_INTERLEAVED,
        activation_bytes_per_layer,
        layers_per_stage,
        microbatches_in_flight_on_rank,
        rope_table_bytes,
    )
    from llmopt.plan.workload import RECOMPUTES, ParallelConfig, Workload

    cfg = crosscheck_model(case.get("tied", False))
    seq, mb = case.get("seq", SEQ), case.get("mb", MB)
    work = Workload(seq_len=seq, global_batch=dp * case["m"] * mb)
    sched = "interleaved" if case["v"] > 1 else case["schedule"]
    par = ParallelConfig(
        tp=case["tp"],
        pp=case["pp"],
        dp=dp,
        sp=case["sp"],
        zero_stage=case["zero"],
        micro_batch=mb,
        num_microbatches=case["m"],
        schedule=sched,
        virtual_stages=case["v"],
        recompute=case["rc"],
    )
    cluster = get_cluster("h100")
    comm = {}
    for stage in ("first", "last"):
        rows = summarize(collectives_for(cfg, work, cluster, par, stage))
        comm[stage] = {
            f"{g}/{op.replace('-', '_')}": {"calls": int(v["calls"]), "bytes": int(v["bytes"])}
            for (g, op), v in rows.items()
        }
    rc = RECOMPUTES.index(case["rc"])
    # Like with like: the planner's "eager" activation model (what this engine's autograd
    # saves, bf16 here), not the fused-kernel Korthikanti default.
    per_layer = float(
        activation_bytes_per_layer(
            cfg, seq, mb, case["tp"], case["sp"], 1, rc, True, False, kernels="eager"
        )
    )
    rope = rope_table_bytes(cfg, seq)  # one cos/sin pair per chunk and micro-batch in flight
    pp, v = np.array(case["pp"]), np.array(case["v"])
    n_layers = float(layers_per_stage(cfg, pp, v))
    code = {"gpipe": SCHED_GPIPE, "1f1b": SCHED_1F1B, "interleaved": SCHED_INTERLEAVED}[sched]
    acts = {}
    for stage, rank in (("first", 0), ("last", case["pp"] - 1)):
        inflight = float(
            microbatches_in_flight_on_rank(pp, np.array(case["m"]), v, np.array(code), rank)
        )
        # Full recompute: the hooks see the kept block inputs, not the layer rebuilt during
        # backward (checkpoint packs those itself), so no working-layer term here.
        acts[stage] = inflight * (per_layer * n_layers + rope * case["v"])
    return {"comm": comm, "activations": acts, "per_layer_activation_bytes": per_layer}
