"""SparseGPT vs an explicit OBS reference; reduces to magnitude with H = I; beats Wanda/magnitude."""

import pytest
import torch

from llmopt.compress.prune.masks import layer_mask, magnitude_score, select_mask, wanda_score
from llmopt.compress.prune.sparsegpt import sparsegpt_solve
from llmopt.models.packed.sparse.config import Sparsity


def _correlated_inputs(n=1024, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=gen) / dim**0.5
    scale = torch.linspace(0.2, 3.0, dim)  # uneven channel energy, like real activations
    return (
        torch.randn(n, dim, generator=gen) @ mix + 0.1 * torch.randn(n, dim, generator=gen)
    ) * scale


def _problem(rows=16, dim=32, seed=0):
    x = _correlated_inputs(dim=dim, seed=seed).double()
    w = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed + 1)).double()
    return w, 2 * x.t() @ x / x.shape[0]


def obs_reference(w, h, sparsity: Sparsity, damp: float, block_size: int):
    """One column at a time with the dense inverse Hessian of the still-free columns.

    Column c's OBS step, with Hinv = (H[c:, c:])^-1: a pruned w_c moves the free weights by
    -w_c / Hinv[0, 0] * Hinv[0, :]. Masks: unstructured, per block of `block_size` columns, the
    lowest w^2 / [H_c^-1]_cc of the block's current weights; N:M, per group of M at its first
    column, the N highest of that saliency in each row.
    """
    w = w.double().clone()
    h = h.double().clone()
    cols = w.shape[1]
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=torch.float64)
    diag_inv = torch.tensor([torch.linalg.inv(h[c:, c:])[0, 0] for c in range(cols)])
    keep = torch.ones_like(w, dtype=torch.bool)
    loss = 0.0
    for c in range(cols):
        if not sparsity.structured and c % block_size == 0:
            end = min(c + block_size, cols)
            sal = w[:, c:end] ** 2 / diag_inv[c:end]
            k = int(sal.numel() * sparsity.fraction)
            order = torch.argsort(sal.flatten())
            block = torch.ones(sal.numel(), dtype=torch.bool)
            block[order[:k]] = False
            keep[:, c:end] = block.view_as(sal)
        if sparsity.structured and c % sparsity.m == 0:
            end = c + sparsity.m
            sal = w[:, c:end] ** 2 / diag_inv[c:end]
            top = torch.argsort(sal, dim=1, descending=True)[:, : sparsity.n]
            keep[:, c:end] = torch.zeros_like(sal, dtype=torch.bool).scatter(1, top, True)
        hinv = torch.linalg.inv(h[c:, c:])
        drop = torch.where(keep[:, c], torch.zeros_like(w[:, c]), w[:, c])
        loss += float((drop**2).sum() / hinv[0, 0]) / 2
        w[:, c:] -= (drop / hinv[0, 0])[:, None] * hinv[0][None, :]
        w[:, c] = torch.where(keep[:, c], w[:, c], torch.zeros_like(w[:, c]))
    return w, keep, loss


@pytest.mark.parametrize("target", ["0.5", "0.7", "2:4", "4:8", "1:4"])
def test_matches_explicit_obs_reference(target):
    sparsity = Sparsity.parse(target)
    w, h = _problem()
    ref_w, ref_keep, ref_loss = obs_reference(w, h, sparsity, damp=0.01, block_size=8)
    got_w, got_keep, got_loss = sparsegpt_solve(w, h, sparsity, damp=0.01, block_size=8)
    assert torch.equal(got_keep, ref_keep)
    assert (got_w - ref_w).abs().max() < 1e-5
    assert got_loss == pytest.approx(ref_loss, rel=1e-6)
    assert torch.equal(got_w == 0, ~ref_keep)
    # float32 input computes in float32: same mask, same weights to fp32 accuracy
    w32, keep32, _ = sparsegpt_solve(w.float(), h.float(), sparsity, damp=0.01, block_size=8)
    assert w32.dtype == torch.float32 and torch.equal(keep32, ref_keep)
    assert (w32.double() - ref_w).abs().max() < 1e-4


def test_lazy_blocks_only_regroup_the_same_updates():
    w, h = _problem()
    a, ka, _ = sparsegpt_solve(w, h, Sparsity.parse("2:4"), block_size=4)
    b, kb, _ = sparsegpt_solve(w, h, Sparsity.parse("2:4"), block_size=32)
    assert torch.equal(ka, kb) and (a - b).abs().max() < 1e-10


def test_identity_hessian_is_magnitude_pruning():
    w = torch.randn(12, 32, generator=torch.Generator().manual_seed(3))
    got, keep, _ = sparsegpt_solve(w, torch.eye(32), Sparsity(0.5), damp=0.0, block_size=32)
    assert torch.equal(keep, layer_mask(w.abs(), 0.5))  # no interaction, no update
    assert torch.equal(got, w * keep)


def test_dead_inputs_are_pruned_and_do_not_break_the_factorisation():
    w, h = _problem()
    h[5, :] = 0.0
    h[:, 5] = 0.0
    got, _, _ = sparsegpt_solve(w, h, Sparsity.parse("2:4"))
    assert torch.isfinite(got).all() and (got[:, 5] == 0).all()


def test_reconstruction_error_orders_sparsegpt_wanda_magnitude():
    # low-rank, unevenly scaled inputs (activations are both): where the three methods differ
    gen = torch.Generator().manual_seed(4)
    mix = torch.randn(8, 64, generator=gen) / 8**0.5
    noise = 0.05 * torch.randn(2048, 64, generator=gen)
    x = (torch.randn(2048, 8, generator=gen) @ mix + noise) * torch.logspace(-1, 1, 64)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    h = 2 * x.t() @ x / x.shape[0]
    for target in ("0.5", "2:4"):
        sparsity = Sparsity.parse(target)
        pruned = {
            "sparsegpt": sparsegpt_solve(w, h, sparsity)[0],
            "wanda": w * select_mask(wanda_score(w, (x * x).sum(0)), sparsity, per_row=True),
            "magnitude": w * select_mask(magnitude_score(w), sparsity, per_row=False),
        }
        err = {k: float((x @ (v - w).t()).pow(2).mean()) for k, v in pruned.items()}
        assert err["sparsegpt"] < 0.7 * err["wanda"] < 0.7 * err["magnitude"], (target, err)


def test_bad_hessian_is_refused():
    w, h = _problem()
    with pytest.raises(ValueError, match="does not match weight"):
        sparsegpt_solve(w, h[:8, :8], Sparsity(0.5))
    with pytest.raises(ValueError, match="not positive definite"):
        sparsegpt_solve(w, -torch.eye(32, dtype=torch.float64), Sparsity(0.5), damp=0.0)
