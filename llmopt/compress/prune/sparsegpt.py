"""SparseGPT (Frantar & Alistarh 2023, arXiv:2301.00774): prune a layer column by column and let
the optimal-brain-surgeon (OBS) update move the pruning error onto the columns not yet visited.

For calibration inputs X the layer loss ||W X - W' X||^2 has Hessian H = 2 X X^T. Pruning
weight w_c of a row, given the inverse Hessian H_F^-1 of the columns F = {c, c+1, ...} still
free, changes the free weights by -w_c / [H_F^-1]_cc * [H_F^-1]_c,: ; the next column's inverse
is that of H with column c eliminated. Those successive inverses are exactly the rows of the
upper Cholesky factor U of H^-1 (row c of U divided by U_cc is [H_F^-1]_c,: and U_cc^2 is
[H_F^-1]_cc), so one factorisation serves every column — the GPTQ trick.

Masks are chosen adaptively: for unstructured sparsity, at the start of each block of
`block_size` columns, from the OBS saliency w^2 / U_cc^2 of the weights as updated so far (one
threshold over the block); for N:M, at the start of each group of M columns. Updates inside a
block are applied at once per column to the block, and to the rest of the matrix lazily, as one
rank-`block_size` product per block. Dampening adds `damp * mean(diag H)` to the diagonal.
"""

from __future__ import annotations

import torch

from llmopt.compress.prune.masks import check_nm_shape, layer_mask, nm_mask
from llmopt.models.packed.sparse.config import Sparsity


def inverse_hessian_factor(hessian: torch.Tensor, damp: float, dtype: torch.dtype) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1; dead inputs get H_jj = 1."""
    h = hessian.to(dtype).clone()
    n = h.shape[0]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n, dtype=dtype, device=h.device)
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(
            f"the damped Hessian is not positive definite (leading minor {int(info)} of {n}); "
            "raise damp or use more calibration tokens"
        )
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


@torch.no_grad()
def sparsegpt_solve(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: Sparsity,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Prune one weight [out, in] given its input Hessian [in, in].

    Returns (pruned weight in the weight's dtype, keep-mask, summed OBS loss
    sum(w_c^2 / U_cc^2) / 2). Computes in float64 for float64 input, else in float32.
    """
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(dtype).clone()
    rows, cols = w.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"Hessian {tuple(hessian.shape)} does not match weight {tuple(w.shape)}")
    w[:, torch.diag(hessian) == 0] = 0.0
    u = inverse_hessian_factor(hessian, damp, dtype)
    if sparsity.structured:
        check_nm_shape(cols, sparsity.m)
        block_size = max(sparsity.m, block_size // sparsity.m * sparsity.m)
    keep = torch.ones(rows, cols, dtype=torch.bool, device=w.device)
    loss = 0.0
    for b1 in range(0, cols, block_size):
        b2 = min(b1 + block_size, cols)
        w1 = w[:, b1:b2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[b1:b2, b1:b2]
        d1 = torch.diag(u1)
        keep1 = keep[:, b1:b2]
        if not sparsity.structured:
            keep1.copy_(layer_mask(w1.pow(2) / d1.pow(2)[None, :], sparsity.fraction))
        for i in range(b2 - b1):
            if sparsity.structured and i % sparsity.m == 0:
                j = i + sparsity.m
                saliency = w1[:, i:j].pow(2) / d1[i:j].pow(2)[None, :]
                keep1[:, i:j] = nm_mask(saliency, sparsity.n, sparsity.m)
            col = w1[:, i]
            pruned = torch.where(keep1[:, i], col, torch.zeros_like(col))
            e = (col - pruned) / d1[i]
            loss += float(e.pow(2).sum()) / 2
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            w1[:, i] = pruned  # exact zeros, not 0 up to rounding
            err1[:, i] = e
        w[:, b1:b2] = w1
        w[:, b2:] -= err1 @ u[b1:b2, b2:]
    return w.to(weight.dtype), keep, loss
