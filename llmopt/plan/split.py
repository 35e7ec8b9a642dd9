"""How the layers are split over pipeline ranks: the most balanced uneven split.

Megatron-Core places layers freely with `--pipeline-model-parallel-layout` (or first/last-stage
layer counts, or `--account-for-embedding/loss-in-pipeline-split`), torchtitan weighs the
embedding and the output layer like layers (`pipeline_parallel_layers_per_stage` and
`generate_llm_fqn_per_model_part`), and llmopt's engine takes explicit `layers_per_stage`. So
the planner does not require pp·v to divide the layers: every rank but the last holds at most
`busiest` layers, and the last rank, which also runs the output layer and the loss (worth
`head_units` layers), holds the rest. The split that minimises the busiest rank's work is
chosen (`rank_layers`); `chunk_layers` lists it per model chunk for the exporters.
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import attention_params, mlp_params


def head_units(model: ModelConfig) -> float:
    """The output layer's GEMM work in units of one block's GEMM work (2·h·V over the block's
    matmul weights a token uses)."""
    mp = mlp_params(model)
    block = attention_params(model) + mp["dense"] + mp["active"] + mp["shared"] + mp["router"]
    return model.hidden_size * model.vocab_size / max(block, 1.0)


def rank_layers(
    model: ModelConfig, pp: np.ndarray | int, v: np.ndarray | int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first rank's, busiest non-last rank's, last rank's) layer counts of the most balanced
    split of the model's layers over `pp` pipeline ranks (each rank's layers spread over its v
    chunks). With pp=1 all three are the layer count."""
    L = model.num_layers
    p = np.asarray(pp, dtype=np.int64)
    u = head_units(model)
    base = -(-L // np.maximum(p, 1))
    best_mid, best_last, best_load = base, base, np.full(p.shape, np.inf)
    for extra in (0, 1):
        mid = base + extra
        last = np.clip(L - (p - 1) * mid, 0, mid)
        load = np.maximum(np.where(p > 1, mid, 0), last + u)
        better = load < best_load - 1e-9
        best_mid = np.where(better, mid, best_mid)
        best_last = np.where(better, last, best_last)
        best_load = np.where(better, load, best_load)
    first = np.clip(L - np.maximum(p - 2, 0) * best_mid - best_last, 0, best_mid)
    one = p <= 1
    full = np.full(p.shape, L)
    return np.where(one, full, first), np.where(one, full, best_mid), np.where(one, full, best_last)


def chunk_layers(model: ModelConfig, pp: int, v: int) -> list[list[int]]:
    """Layers of each model chunk, [rank][virtual stage], of the split `rank_layers` prices:
    each rank's layers spread as evenly as possible over its v chunks, the first chunk of the
    first rank (embedding) and the last chunk of the last rank (output layer) lightest."""
    first, mid, last = (int(x) for x in rank_layers(model, pp, v))
    counts = [first] + [mid] * max(pp - 2, 0) + ([last] if pp > 1 else [])
    out = []
    for r, n in enumerate(counts):
        chunks = [n // v + (1 if c < n % v else 0) for c in range(v)]
        if r == pp - 1:
            chunks.reverse()  # the remainder on the earlier chunks; the loss chunk is lightest
        else:
            chunks = chunks[::-1] if r == 0 else chunks
        out.append(chunks)
    return out


def is_even(model: ModelConfig, pp: int, v: int) -> bool:
    """Whether every chunk holds the same number of layers (no layout flags needed)."""
    chunks = [c for rank in chunk_layers(model, pp, v) for c in rank]
    return len(set(chunks)) == 1
