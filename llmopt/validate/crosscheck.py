"""The engine's side of planner-vs-engine: measured bytes of one step of a small 3D config.

`engine_step(rank, world, case)` runs one optimizer step on this rank (inside an initialised
gloo world) and returns its counted communication per (group, op) and the peak bytes its
transformer blocks saved for backward, in bf16 with fp32 gradient reduction (the planner's
"megatron" numerics). The planner's prediction of the same numbers is
`llmopt.validate.planner_engine.planner_prediction`, on the same case (`crosscheck_model`,
SEQ, MB defined here once). Both sides live in llmopt.validate, above the engine and the
planner, so llmopt.parallel never imports the planner nor the check.

A case is a `CrosscheckCase`: the `ParallelPlan` both sides run, plus the sequence length
and whether the embeddings are tied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.plan import ParallelPlan

SEQ, MB = 16, 2


@dataclass(frozen=True)
class CrosscheckCase:
    """One planner-vs-engine config: the plan (bf16 with fp32 gradient reduction, the
    planner's "megatron" numerics) on `crosscheck_model(tied)` at `seq` tokens."""

    plan: ParallelPlan
    seq: int = SEQ
    tied: bool = False

    @classmethod
    def of(cls, *, seq: int = SEQ, tied: bool = False, **plan: Any) -> CrosscheckCase:
        """A case from `ParallelPlan` fields (micro_batch defaults to MB)."""
        return cls(ParallelPlan(**{"micro_batch": MB, "precision": "bf16", **plan}), seq, tied)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "seq": self.seq, "tied": self.tied}


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


def engine_step(rank: int, world: int, case: CrosscheckCase) -> dict:
    """One optimizer step on this rank: counted communication and block activation peak."""
    from llmopt.parallel.comm import CommCounter
    from llmopt.parallel.engine import parallelize
    from llmopt.parallel.grid import ParallelDims, RankGrid
    from llmopt.validate.pipeline_measure import SavedTensorMeter

    plan = case.plan
    if world != plan.world_size:
        raise ValueError(f"the case {plan.short()} runs on {plan.world_size} ranks, not {world}")
    cfg = crosscheck_model(case.tied)
    seq, mb = case.seq, plan.micro_batch
    grid = RankGrid.create(ParallelDims(world, tp=plan.tp, pp=plan.pp))
    engine = parallelize(build_model(cfg, seed=0), grid, plan)
    opt = torch.optim.AdamW(engine.master_params(), lr=1e-3)
    gen = torch.Generator().manual_seed(grid.dp.rank)
    data = torch.randint(0, cfg.vocab_size, (plan.num_microbatches * mb, seq + 1), generator=gen)
    blocks = engine.rank_module.blocks
    exclude = list(engine.rank_module.parameters()) + [u.flat for u in engine.dp.units]
    before = grid.counter.snapshot()
    with SavedTensorMeter(exclude, only_inside=blocks) as meter:
        result = engine.forward_backward(data[:, :-1], data[:, 1:])
    engine.clip_grad_norm_(1.0)
    opt.step()
    engine.update_params()
    engine.zero_grad()
    counts = CommCounter.delta(grid.counter.snapshot(), before)
    return {
        "coords": grid.dims.coords(rank),
        "comm": _flat(counts),
        "activation_peak_bytes": meter.peak,
        "layers": len(blocks),
        "loss": engine.global_loss(result),
    }
