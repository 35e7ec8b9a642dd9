"""TP/SP/DP/ZeRO/recompute through `parallelize` (pp=1: a one-stage pipeline) against a
single plain process, on gloo CPU processes.

Each case trains a tiny Llama for a few AdamW steps (with gradient clipping active) from the
same initial weights and the same global batch, and compares with one process:
losses, the reduced gradients before the first step, and the final parameters.

Tolerance: 1e-5 relative (norm-wise) in fp32. Sharding only reorders floating-point sums (a
TP all-reduce sums partial matmuls; DP averages per-rank means), which moves results by a few
ulps (~1e-7 relative). Adam normalises each element's step to about lr, so an element whose
gradient is near zero can move by up to 2 lr on a few-ulp difference; lr=1e-3 (much smaller
than the 0.02-std weights) keeps the parameter error after three steps near 1e-7 (lr=1e-2 gives
~5e-5 for the same, correct, gradients). The parameters' bound is looser (PARAM_TOL): the
error is the worst tensor's, and one element of a 64-wide norm whose gradient sits within a
few ulps of zero moves by up to 2 lr whichever way the sums round; an AVX2-only host (whose
BLAS orders its sums differently from an AVX-512 one) measured 1.04e-5 on the 8-rank cases
with losses and gradients within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.models import build_model
from llmopt.parallel.engine import parallelize
from llmopt.parallel.grid import ParallelDims, RankGrid
from llmopt.parallel.optim import AdamW
from llmopt.parallel.plan import ParallelPlan
from llmopt.parallel.tensor_parallel import lm_loss
from tests.dist_helpers import run_distributed
from tests.tiny_models import tiny_gqa_config

CFG = tiny_gqa_config()
GLOBAL_BATCH, SEQ, STEPS, LR, CLIP = 4, 16, 3, 1e-3, 0.5
TOL = 1e-5
PARAM_TOL = 5e-5


def _batches():
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return data[..., :-1], data[..., 1:]


def _optimizer(params, reference: bool = False):
    if reference:  # torch's own AdamW checks ours (llmopt.parallel.optim) as well
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)
    return AdamW(params, lr=LR, weight_decay=0.1)


def reference() -> dict:
    """One process, plain model, full global batch."""
    model = build_model(CFG, seed=0)
    opt = _optimizer(model.parameters(), reference=True)
    tokens, targets = _batches()
    losses, grads, norms = [], None, []
    for step in range(STEPS):
        loss = lm_loss(model, tokens[step], targets[step])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert min(norms) > CLIP  # clipping is active in every step
    return {"losses": losses, "grads": grads, "params": dict(model.state_dict()), "norms": norms}


def _plan(world: int, tp: int = 1, num_microbatches: int = 1, **fields) -> ParallelPlan:
    """A case on `world` ranks: dp = world / tp, GLOBAL_BATCH split into `num_microbatches`."""
    dp = world // tp
    micro_batch = GLOBAL_BATCH // dp // num_microbatches
    return ParallelPlan(tp=tp, dp=dp, micro_batch=micro_batch,
                        num_microbatches=num_microbatches, precision="fp32", **fields)  # fmt: skip


def run_case(world: int, plan: ParallelPlan) -> dict:
    grid = RankGrid.create(ParallelDims(world, tp=plan.tp))
    assert grid.dp.size == plan.dp, (plan.short(), world)
    local = GLOBAL_BATCH // grid.dp.size
    engine = parallelize(build_model(CFG, seed=0), grid, plan)
    opt = _optimizer(engine.master_params())
    tokens, targets = _batches()
    rows = slice(grid.dp.rank * local, (grid.dp.rank + 1) * local)
    losses, grads, norms = [], None, []
    for step in range(STEPS):
        result = engine.forward_backward(tokens[step][rows], targets[step][rows])
        if step == 0:
            grads = engine.full_grads()
        norms.append(engine.clip_grad_norm_(CLIP))
        opt.step()
        engine.update_params()
        engine.zero_grad()
        losses.append(engine.global_loss(result))
    return {"losses": losses, "grads": grads, "params": engine.full_params(), "norms": norms}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(result: dict, ref: dict) -> dict:
    err = {"loss": max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"]))}
    err["grad_norm"] = max(abs(a - b) / b for a, b in zip(result["norms"], ref["norms"]))
    assert set(result["grads"]) == set(ref["grads"])
    err["grad"] = max(_rel(result["grads"][n], ref["grads"][n]) for n in ref["grads"])
    err["param"] = max(_rel(result["params"][n], ref["params"][n]) for n in ref["grads"])
    return err


def _worker(rank: int, world: int, cases: list[ParallelPlan], ref: dict) -> list[dict]:
    return [compare(run_case(world, case), ref) for case in cases]


CASES = {
    2: [
        _plan(2, tp=2),
        _plan(2, tp=2, sequence_parallel=True, recompute="selective"),
        _plan(2, zero_stage=0, num_microbatches=2),
        _plan(2, zero_stage=1),
        _plan(2, zero_stage=2, recompute="full"),
        _plan(2, zero_stage=3, num_microbatches=2, recompute="full"),
        _plan(2, zero_stage=3, recompute="selective"),
    ],
    4: [
        _plan(4, tp=2, sequence_parallel=True, zero_stage=1, recompute="selective"),
        _plan(4, tp=4, sequence_parallel=True, recompute="full"),
        _plan(4, tp=2, sequence_parallel=True, zero_stage=3, num_microbatches=2),
    ],
    8: [_plan(8, tp=4, sequence_parallel=True, zero_stage=2, recompute="full")],
}


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_zero_stage_on_one_rank_matches(zero, ref):
    # dp=1: reductions are local copies (no work handle); accumulation must still sum.
    err = compare(run_case(1, _plan(1, zero_stage=zero, num_microbatches=2)), ref)
    for key, value in err.items():
        bound = PARAM_TOL if key == "param" else TOL
        assert value <= bound, f"zero={zero}: {key} rel error {value:.2e}"


@pytest.mark.parametrize("world", sorted(CASES))
@pytest.mark.dist
def test_parity_with_single_process(world, ref):
    errors = run_distributed(_worker, world, CASES[world], ref, timeout_s=300)
    for rank, per_case in enumerate(errors):
        for case, err in zip(CASES[world], per_case):
            for key, value in err.items():
                bound = PARAM_TOL if key == "param" else TOL
                assert value <= bound, f"rank {rank} case {case}: {key} rel error {value:.2e}"
