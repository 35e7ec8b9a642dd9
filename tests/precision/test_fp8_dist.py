"""FP8 composes with data and tensor parallelism: 2 gloo processes vs one process.

With amaxes MAX-reduced over the group, every rank quantises with the scale the single
process derives from the whole tensor (the max of the shard amaxes *is* the full amax), so
each FP8 element is identical and only fp32 summation order differs between the runs. The
scales are compared to 1e-6 relative, losses to 1e-5, and gradients / parameter updates to
1e-4 relative (Frobenius norm). Observed: <= 4e-7 (summation order). The bound leaves room
for an occasional FP8 rounding flip caused by that noise (one element moving by one FP8
step) without admitting unequal scales, which change every element's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.models import ModelConfig, build_model
from llmopt.precision.fp8 import convert_to_fp8, fp8_modules, set_amax_group
from tests.dist_helpers import run_distributed

pytestmark = pytest.mark.dist  # every test here spawns a gloo world

CFG = ModelConfig(
    name="tiny-fp8",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
)
BATCH, SEQ, STEPS = 4, 24, 3


def _data(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)


def _scales(model) -> dict[str, list[float]]:
    return {
        name: [m.scalers[r].scale.item() for r in ("input", "weight", "grad_output")]
        for name, m in fp8_modules(model).items()
    }


def _train(model, rank: int, world: int, group_sum) -> tuple[list[float], dict]:
    """STEPS of AdamW on this rank's slice of each global batch; grads summed by `group_sum`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        tokens = _data(step).chunk(world)[rank]
        logits = model(tokens[:, :-1])
        # sum over local tokens / global token count: the DP sum of grads is the global mean
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum"
        ) / (BATCH * SEQ)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            group_sum(p.grad)
        group_sum(loss.detach())
        losses.append(loss.item())
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


DP_CONFIGS = (("current", True), ("delayed", True), ("current", False))  # (recipe, reduce)


def _dp_worker(rank: int, world: int):
    """Every DP configuration in one launch (process start-up dominates on 2 cores)."""
    import torch.distributed as dist

    out = {}
    for recipe, reduce in DP_CONFIGS:
        group = "auto" if reduce else None
        model = convert_to_fp8(build_model(CFG, seed=0), recipe, amax_group=group)
        losses, state = _train(model, rank, world, lambda t: dist.all_reduce(t))
        out[recipe, reduce] = losses, _to_numpy(state), _scales(model)
    return out


@pytest.fixture(scope="module")
def dp_results():
    return run_distributed(_dp_worker, 2, timeout_s=240)


def _to_numpy(tensors: dict[str, torch.Tensor]) -> dict:
    # plain pickles: torch's shared-memory tensor passing needs the sender to outlive the read
    return {k: v.numpy() for k, v in tensors.items()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_data_parallel_matches_single_process(recipe, dp_results):
    init = build_model(CFG, seed=0).state_dict()
    single = convert_to_fp8(build_model(CFG, seed=0), recipe)
    ref_losses, ref_state = _train(single, 0, 1, lambda t: None)
    ref_scales = _scales(single)
    results = [by_config[recipe, True] for by_config in dp_results]
    for losses, state, scales in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, want in ref_scales.items():
            assert scales[name] == pytest.approx(want, rel=1e-6), name
        for key, want in ref_state.items():
            update, ref_update = torch.from_numpy(state[key]) - init[key], want - init[key]
            assert _relative(update, ref_update) < 1e-4, key
    # the ranks saw different data, yet quantised with identical scales
    assert results[0][2] == results[1][2]


def test_fp8_data_parallel_without_amax_reduction_diverges_in_scales(dp_results):
    results = [by_config["current", False] for by_config in dp_results]
    in0 = [v[0] for v in results[0][2].values()]
    in1 = [v[0] for v in results[1][2].values()]
    assert in0 != in1  # each rank scaled its own activations: what the reduction prevents


def _tp_worker(rank: int, world: int):
    return {recipe: _tp_one(rank, world, recipe) for recipe in ("current", "delayed")}


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, timeout_s=240)


def _tp_one(rank: int, world: int, recipe: str):
    from llmopt.parallel.grid import ParallelDims, RankGrid
    from llmopt.parallel.tensor_parallel import apply_tensor_parallel, gather_tp_tensor, lm_loss

    grid = RankGrid.create(ParallelDims(world, tp=world))
    model = apply_tensor_parallel(build_model(CFG, seed=0), grid.tp)
    convert_to_fp8(model, recipe, amax_group=grid.tp)
    losses = []
    for step in range(2):  # two steps: delayed scaling uses step 0's amaxes in step 1
        model.zero_grad()
        tokens = _data(step)
        loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        if hasattr(p, "tp_dim"):
            grad.tp_dim = p.tp_dim  # gather_tp_tensor reads the shard dim off its argument
        grads[name] = gather_tp_tensor(grad, grid.tp)
    # parameter names changed nowhere: same keys as the single-process model
    scales = _scales(model)
    # amax reductions go through the engine's counted group: 3 per FP8 layer per fwd+bwd
    calls = []
    for group in (grid.tp, None):
        set_amax_group(model, group)
        before = grid.counter.calls("tp", "all_reduce")
        lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        calls.append(grid.counter.calls("tp", "all_reduce") - before)
    return losses, _to_numpy(grads), scales, calls[0] - calls[1]


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_tensor_parallel_matches_single_process(recipe, tp_results):
    single = convert_to_fp8(build_model(CFG, seed=0), recipe)
    ref_losses = []
    for step in range(2):
        single.zero_grad()
        tokens = _data(step)
        logits = single(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        ref_losses.append(loss.item())
    ref_scales = _scales(single)
    results = [by_recipe[recipe] for by_recipe in tp_results]
    for losses, grads, scales, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, want in ref_scales.items():
            assert scales[name] == pytest.approx(want, rel=1e-6), name
        for name, p in single.named_parameters():
            assert _relative(torch.from_numpy(grads[name]), p.grad) < 1e-4, name
    assert results[0][3] == results[1][3] == 3 * 7 * CFG.num_layers
