"""3D parallelism (TP/SP x PP x DP/ZeRO, with recompute) against one process, on gloo.

Each rank computes the single-process reference for the global batch itself (tiny model),
then runs its part: the loss of step 1 (as logged, on every rank), this rank's reduced
gradients (TP- and ZeRO-gathered) before the first optimizer step, and the loss of step 2
after an SGD step must match.

Tolerance 1e-5 relative (loss; gradients norm-wise per tensor): TP all-reduces, DP averaging
and micro-batch accumulation reorder fp32 sums (observed ~1e-7). SGD keeps the step-2 check
free of Adam's amplification of near-zero gradients.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.pipeline.executor import cross_entropy_sum
from llmopt.parallel.pipeline.schedule import ScheduleError
from llmopt.parallel.plan import ParallelPlan, PlanError
from tests.dist_helpers import run_distributed

TOL = 1e-5
SEQ, MB, LR = 8, 2, 0.1


def _config(tie: bool) -> ModelConfig:
    return ModelConfig(
        name="tiny-3d",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=32,
        tie_embeddings=tie,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _worker(rank: int, world: int, cases: list[tuple[ParallelPlan, bool]]):
    from llmopt.parallel.engine import parallelize
    from llmopt.parallel.grid import ParallelDims, RankGrid

    report = []
    for plan, tie in cases:
        case = plan.short()
        cfg = _config(tie)
        grid = RankGrid.create(ParallelDims(world, tp=plan.tp, pp=plan.pp))
        dp, m = plan.dp, plan.num_microbatches
        assert grid.dp.size == dp, (case, world)
        gen = torch.Generator().manual_seed(7)
        data = torch.randint(0, cfg.vocab_size, (2, dp * m * MB, SEQ + 1), generator=gen)
        tokens, labels = data[..., :-1], data[..., 1:]

        ref = build_model(cfg, seed=3)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        ref_losses = []
        for step in range(2):
            loss = cross_entropy_sum(ref(tokens[step]), labels[step]) / labels[step].numel()
            loss.backward()
            if step == 0:
                ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
                ref_grads["lm_head.weight"] = ref.lm_head.weight.grad.clone()
                ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())

        pm = parallelize(build_model(cfg, seed=3), grid, plan)
        opt = torch.optim.SGD(pm.master_params(), lr=LR)
        rows = slice(grid.dp.rank * m * MB, (grid.dp.rank + 1) * m * MB)
        result = pm.forward_backward(tokens[0][rows], labels[0][rows])
        loss1 = pm.global_loss(result)
        grads = pm.full_grads()
        norm = pm.grad_norm()  # the tied weight counts once, as in the reference
        assert abs(norm - ref_norm.item()) <= TOL * ref_norm.item(), (case, norm, ref_norm)
        optimizer_step(pm, opt)
        loss2 = pm.step(tokens[1][rows], labels[1][rows], opt).loss

        full = pm.full_state_dict()  # the whole model, gathered over TP, DP and PP
        if grid.pp.rank == 0:
            ref_state = ref.state_dict()
            assert set(full) == set(ref_state) - {"rotary.cos", "rotary.sin"}
            for name, value in full.items():
                assert _rel(value, ref_state[name]) <= TOL, (case, name)
        else:
            assert full == {}
        for got, want in ((loss1, ref_losses[0]), (loss2, ref_losses[1])):
            assert abs(got - want) <= TOL * abs(want), (case, got, want)
        assert grads, "every rank holds parameters"
        worst = 0.0
        for name, g in grads.items():
            err = _rel(g, ref_grads[name])
            assert err <= TOL, f"{case}: grad {name} rel err {err:.2e}"
            worst = max(worst, err)
        report.append(worst)
    return report


def optimizer_step(pm, opt) -> None:
    pm.clip_grad_norm_(None)
    opt.step()
    pm.update_params()
    pm.zero_grad()


def _plan(**fields) -> ParallelPlan:
    """A case's plan: fp32 (compared with one fp32 process), MB sequences per micro-batch."""
    return ParallelPlan(micro_batch=MB, precision="fp32", **fields)


CASES_8 = [  # (plan, tied embeddings)
    # The example: tp2 . pp2 . dp2 with ZeRO-1 and selective recompute.
    (_plan(tp=2, pp=2, dp=2, num_microbatches=3, zero_stage=1, recompute="selective"), False),
]
CASES_4 = [
    (_plan(pp=2, dp=2, schedule="gpipe", num_microbatches=2, zero_stage=3), True),
    (_plan(tp=2, pp=2, num_microbatches=2, sequence_parallel=True, recompute="full"), True),
    (_plan(pp=2, dp=2, schedule="interleaved", virtual_stages=2, num_microbatches=5, zero_stage=2), True),
]  # fmt: skip


@pytest.mark.parametrize("world,cases", [(4, CASES_4), (8, CASES_8)])
@pytest.mark.dist
def test_3d_matches_single_process(world, cases):
    reports = run_distributed(_worker, world, cases, timeout_s=300)
    assert all(len(r) == len(cases) for r in reports)


def test_bad_pipeline_configs_are_rejected_clearly():
    from llmopt.parallel.comm import CommCounter, Group
    from llmopt.parallel.engine import EngineError, parallelize
    from llmopt.parallel.grid import ParallelDims, RankGrid

    with pytest.raises(PlanError, match="schedule='zb' is not valid; choose one of gpipe"):
        ParallelPlan(schedule="zb")
    with pytest.raises(PlanError, match="num_microbatches=0 must be a positive integer"):
        ParallelPlan(num_microbatches=0)
    with pytest.raises(ScheduleError, match="'interleaved-1f1b' is now called 'interleaved'"):
        from llmopt.parallel.pipeline.schedule import build_schedule

        build_schedule("interleaved-1f1b", 2, 4, 2)
    counter = CommCounter()
    groups = {d: Group(d, (0,), 0, None, counter) for d in ("tp", "cp", "dp", "world")}
    groups["pp"] = Group("pp", (0, 1, 2, 3), 0, None, counter)  # rank 0 of a pp=4 grid
    grid = RankGrid(ParallelDims(4, pp=4), 0, groups, counter)
    model = build_model(_config(False), seed=0)
    pp4 = ParallelPlan(pp=4, num_microbatches=4)
    with pytest.raises(ScheduleError, match=r"layers_per_stage=\[1, 1, 1, 2\] must be"):
        parallelize(model, grid, pp4.replace(layers_per_stage=(1, 1, 1, 2)))
    with pytest.raises(EngineError, match="plan tp=2 but the rank grid has tp=1"):
        parallelize(model, grid, pp4.replace(tp=2))
    with pytest.raises(ScheduleError, match="interleaved needs num_microbatches >= pp"):
        parallelize(
            model, grid, pp4.replace(schedule="interleaved", num_microbatches=2, virtual_stages=2)
        )
    with pytest.raises(ScheduleError, match=r"num_layers=4 is fewer than pp\*v=8 stages"):
        parallelize(model, grid, pp4.replace(schedule="interleaved", virtual_stages=2))
    assert not hasattr(model, "tp_group")  # rejected before the model was touched
