"""Keep-masks from importance scores: exact counts, whatever the ties.

Every selector returns a bool mask (True = kept) of the score's shape and prunes exactly the
number of weights the target implies (`topk` picks among equal scores, so ties never change the
count). Three comparison groups:

- `layer_mask`: one threshold over the whole matrix (classic magnitude pruning).
- `row_mask`: the same fraction in every output row (Wanda compares scores per output).
- `nm_mask`: N kept in every group of M consecutive inputs of a row (N:M).
"""

from __future__ import annotations

import torch

from llmopt.models.packed.sparse.config import PruneConfigError, Sparsity, check_nm_shape


def layer_mask(score: torch.Tensor, fraction: float) -> torch.Tensor:
    """Prune the int(fraction * numel) lowest scores of the whole matrix."""
    k = int(score.numel() * fraction)
    keep = torch.ones(score.numel(), dtype=torch.bool, device=score.device)
    if k:
        keep[torch.topk(score.flatten(), k, largest=False).indices] = False
    return keep.view_as(score)


def row_mask(score: torch.Tensor, fraction: float) -> torch.Tensor:
    """Prune the int(fraction * in_features) lowest scores of every row."""
    k = int(score.shape[-1] * fraction)
    keep = torch.ones_like(score, dtype=torch.bool)
    if k:
        keep.scatter_(-1, torch.topk(score, k, dim=-1, largest=False).indices, False)
    return keep


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the n highest scores in each group of m consecutive columns of every row."""
    rows, cols = score.shape
    check_nm_shape(cols, m)
    groups = score.reshape(rows, cols // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, torch.topk(groups, n, dim=-1).indices, True)
    return keep.reshape(rows, cols)


def select_mask(score: torch.Tensor, sparsity: Sparsity, per_row: bool) -> torch.Tensor:
    """The keep-mask for a target: N:M groups, else per row or per layer."""
    if sparsity.structured:
        return nm_mask(score, sparsity.n, sparsity.m)
    return row_mask(score, sparsity.fraction) if per_row else layer_mask(score, sparsity.fraction)


def magnitude_score(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().abs()


def wanda_score(weight: torch.Tensor, input_sq_norms: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2 (Sun et al. 2023), from the squared norms of the input features."""
    if input_sq_norms.shape != weight.shape[-1:]:
        raise PruneConfigError(
            f"Wanda needs one input norm per input feature ({weight.shape[-1]}); got "
            f"{tuple(input_sq_norms.shape)}"
        )
    return weight.detach().float().abs() * input_sq_norms.float().clamp_min(0).sqrt()[None, :]
