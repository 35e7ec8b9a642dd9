"""The layouts the engine used to refuse, on 8 gloo processes against one process: ZeRO-3
with pp=4, FP8 with pp=2 (amaxes reduced over the ranks holding each stage), uneven pipeline
splits (3 + 5 layers; Megatron's embedding/loss-counted split), and checkpoints resharded
across tp/pp/dp/ep/ZeRO layouts (a dense and a MoE model).

Every rank computes the single-process reference itself (tiny models). fp32 layouts match it
to 1e-5 (loss; gradients norm-wise per tensor). FP8 runs the reference in FP8 too, over the
same token sets per micro-batch (the data-parallel replicas' j-th micro-batches together: that
is what the MAX-reduced amaxes see), to 1e-5 on the loss and 1e-4 on gradients, as
tests/precision/test_fp8_dist.py argues (one FP8 rounding step may flip on summation-order noise).
"""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ModelConfig, build_model
from llmopt.models.moe import MoEConfig
from llmopt.parallel.pipeline.executor import cross_entropy_sum
from llmopt.parallel.plan import ParallelPlan
from tests.dist_helpers import run_distributed

SEQ, MB = 16, 2
DENSE = dict(
    name="tiny-8", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8,
    num_heads=4, num_kv_heads=2, max_seq_len=32,
)  # fmt: skip
MOE = dict(DENSE, architecture="mixtral", moe=MoEConfig(8, 2, 64), intermediate_size=64)
# name: (model fields, plan fields, fp8)
CASES = {
    "zero3_pp4": (DENSE, dict(pp=4, zero_stage=3, num_microbatches=4), False),
    "uneven_3_5": (
        DENSE, dict(tp=2, pp=2, zero_stage=1, num_microbatches=2, layers_per_stage=(3, 5)), False
    ),
    "megatron_split": (
        dict(DENSE, num_layers=6),
        dict(pp=4, num_microbatches=4, account_for_embedding=True, account_for_loss=True),
        False,
    ),
    "fp8_pp2": (DENSE, dict(tp=2, pp=2, num_microbatches=2), True),
}  # fmt: skip


def _plan(world: int, fields: dict, fp8: bool) -> ParallelPlan:
    base = dict(micro_batch=MB, precision="fp8" if fp8 else "fp32")
    base.update(fields)
    tp, pp = base.get("tp", 1), base.get("pp", 1)
    return ParallelPlan(dp=world // (tp * pp), **base)


def _data(plan: ParallelPlan, step: int, vocab: int):
    gen = torch.Generator().manual_seed(11 + step)
    rows = plan.dp * plan.num_microbatches * MB
    data = torch.randint(0, vocab, (rows, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _reference(cfg: ModelConfig, plan: ParallelPlan, fp8: bool):
    """Loss and gradients of one step over the plan's micro-batches (the replicas' j-th
    micro-batches in one forward each: the token sets an FP8 amax spans)."""
    model = build_model(cfg, seed=3)
    if fp8:
        from llmopt.precision.fp8 import convert_to_fp8

        convert_to_fp8(model, plan.fp8_recipe, amax_group=None)
    tokens, labels = _data(plan, 0, cfg.vocab_size)
    m, per = plan.num_microbatches, plan.num_microbatches * MB
    total = 0.0
    for j in range(m):
        rows = torch.cat(
            [torch.arange(r * per + j * MB, r * per + (j + 1) * MB) for r in range(plan.dp)]
        )
        loss = cross_entropy_sum(model(tokens[rows]), labels[rows]) / labels.numel()
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def _engine(world: int, cfg: ModelConfig, plan: ParallelPlan):
    from llmopt.parallel.engine import parallelize
    from llmopt.parallel.grid import ParallelDims, RankGrid

    grid = RankGrid.create(ParallelDims.of_plan(plan))
    return grid, parallelize(build_model(cfg, seed=3), grid, plan)


def _rows(grid, plan):
    per = plan.num_microbatches * MB
    return slice(grid.dp.rank * per, (grid.dp.rank + 1) * per)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _match_worker(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        fields, plan_fields, fp8 = CASES[name]
        cfg, plan = ModelConfig(**fields), _plan(world, plan_fields, fp8)
        ref_loss, ref_grads = _reference(cfg, plan, fp8)
        grid, engine = _engine(world, cfg, plan)
        tokens, labels = _data(plan, 0, cfg.vocab_size)
        rows = _rows(grid, plan)
        loss = engine.global_loss(engine.forward_backward(tokens[rows], labels[rows]))
        grads = engine.to_first_stage(engine.full_grads())
        out[name] = {
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "grad": max((_rel(g, ref_grads[n]) for n, g in grads.items()), default=0.0),
            "complete": not grads or set(grads) == set(ref_grads),
            "split": [len(s.layer_indices) for s in engine.stages],
        }
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_zero3_pp4_fp8_pp2_and_uneven_splits_match_one_process():
    per_rank = run_distributed(_match_worker, 8, list(CASES), timeout_s=900)
    for name, (_, _, fp8) in CASES.items():
        err = per_rank[0][name]
        assert err["complete"] and err["loss"] < 1e-5, (name, err)
        assert err["grad"] < (1e-4 if fp8 else 1e-5), (name, err)
    splits = [r["uneven_3_5"]["split"] for r in per_rank]
    assert sorted({tuple(s) for s in splits}) == [(3,), (5,)]  # pp rank 0: 3 layers, 1: 5
    assert sorted({tuple(r["megatron_split"]["split"]) for r in per_rank}) == [(1,), (2,)]


# ---- resharding: train in layout A, checkpoint, resume in layout B ----
RESHARD = [
    # (model, layout A, layout B)
    (DENSE, dict(tp=2, pp=2, zero_stage=1, layers_per_stage=(3, 5)), dict(pp=4, zero_stage=3)),
    (MOE, dict(tp=2, pp=2, ep=2, zero_stage=2), dict(ep=8, zero_stage=1, expert_tp=1)),
]


def _steps(engine, grid, plan, opt, steps, vocab) -> list[float]:
    losses = []
    for step in steps:
        tokens, labels = _data(plan, step, vocab)
        rows = _rows(grid, plan)
        losses.append(engine.step(tokens[rows], labels[rows], opt, max_norm=1.0).loss)
    return losses


def _reshard_worker(rank: int, world: int, root: str) -> list[dict]:
    from llmopt.parallel.optim import AdamW
    from llmopt.train.checkpoint import load_checkpoint, save_checkpoint

    out = []
    for i, (fields, a, b) in enumerate(RESHARD):
        cfg = ModelConfig(**fields)
        plan_a = _plan(world, dict(a, num_microbatches=4), False)
        dp_b = world // (b.get("tp", 1) * b.get("pp", 1))  # the same global batch in B
        plan_b = _plan(world, dict(b, num_microbatches=plan_a.dp * 4 // dp_b), False)
        grid, engine = _engine(world, cfg, plan_a)
        opt = AdamW(engine.master_params(), lr=1e-3)
        _steps(engine, grid, plan_a, opt, range(2), cfg.vocab_size)
        path = save_checkpoint(f"{root}/{i}", 2, engine, opt, grid, {})
        cont = _steps(engine, grid, plan_a, opt, range(2, 4), cfg.vocab_size)
        final = engine.to_first_stage(engine.full_params())
        grid, engine = _engine(world, cfg, plan_b)
        opt = AdamW(engine.master_params(), lr=1e-3)
        manifest = load_checkpoint(path, engine, opt, grid)
        resumed = _steps(engine, grid, plan_b, opt, range(2, 4), cfg.vocab_size)
        again = engine.to_first_stage(engine.full_params())
        out.append({
            "resharded": "resharded_from" in manifest,
            "loss": max(abs(x - y) / abs(y) for x, y in zip(resumed, cont)),
            "param": max((_rel(again[n], t) for n, t in final.items()), default=0.0)
            if final and again else 0.0,
        })  # fmt: skip
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_checkpoints_reshard_across_tp_pp_dp_ep_layouts(tmp_path):
    per_rank = run_distributed(_reshard_worker, 8, str(tmp_path), timeout_s=900)
    for case, err in zip(RESHARD, per_rank[0]):
        assert err["resharded"], case
        assert err["loss"] < 1e-5 and err["param"] < 1e-5, (case, err)
