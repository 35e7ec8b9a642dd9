"""Ring attention (context parallelism) in the cost model.

Each of the cp ranks holds 2 of the 2·cp sequence chunks (the zig-zag split: chunk i and
2·cp-1-i, so every rank has the same share of the causal triangle). Per attention layer and
micro-batch the ranks pass K/V blocks round the ring: cp-1 point-to-point steps, each sending
this rank's K/V block to the next rank while receiving the previous one's. Step j's transfer
overlaps the attention of the block received at step j-1, so a step is exposed only by what
its transfer takes beyond that block's compute (1/cp of the rank's attention). Backward sends
K/V and their gradients (twice the bytes) against backward attention (twice the compute);
full recomputation repeats the forward ring. Without the zig-zag split (contiguous chunks) the
busiest rank's causal attention is 2·cp/(cp+1) times the mean (`causal_imbalance`).

`llmopt.plan.comm` books the same ring as send/recv rows of `kv_block_bytes` (what
`llmopt.parallel.context_parallel` does and its counter sees): cp-1 blocks forward, cp-1
double blocks backward, plus one last hop per layer and micro-batch that takes the dK/dV
home. That hop (one block, against the 3(cp-1) above) is not priced here, so the step times
this model gives, and the planner's validation numbers for CP runs, are the ones before the
table described the ring.
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.plan.grid import Grid
from llmopt.plan.hardware import Cluster
from llmopt.plan.memory import ACT_BYTES, kv_heads_per_rank

# Megatron-Core / Transformer Engine (cp_comm_type p2p) and torchtitan split causal sequences
# zig-zag; the planner prices that.
CP_LOAD_BALANCED = True


def causal_imbalance(cp: np.ndarray, balanced: bool = True) -> np.ndarray:
    """Busiest rank's causal attention over the mean: 1 for the zig-zag split, 2cp/(cp+1)
    for contiguous chunks (rank cp-1 computes cp of the cp(cp+1)/2 blocks)."""
    c = np.asarray(cp, dtype=np.float64)
    return np.ones_like(c) if balanced else 2 * c / (c + 1)


def kv_block_bytes(model: ModelConfig, grid: Grid, seq_len: int) -> np.ndarray:
    """K and V of one rank's sequence share (s/cp tokens, this TP rank's KV heads), bf16."""
    kv = 2 * kv_heads_per_rank(model, grid["tp"]) * model.head_dim * ACT_BYTES
    return grid["mb"] * (seq_len / grid["cp"]) * kv


def ring_exposed_seconds(
    model: ModelConfig,
    cluster: Cluster,
    grid: Grid,
    seq_len: int,
    attn_fwd_s: np.ndarray,
    cp_crosses_nodes: np.ndarray,
    full_recompute: np.ndarray,
) -> np.ndarray:
    """Exposed ring time of one layer and micro-batch, forward + backward (+ recomputed
    forward), given the busiest rank's forward attention seconds `attn_fwd_s` (the step
    time charges that rank's attention: × `causal_imbalance`)."""
    cp = grid["cp"].astype(np.float64)
    intra, inter = cluster.intra_node, cluster.inter_node
    bw = np.where(cp_crosses_nodes, inter.bytes_per_s, intra.bytes_per_s)
    lat = np.where(cp_crosses_nodes, inter.latency_us, intra.latency_us) * 1e-6
    block = kv_block_bytes(model, grid, seq_len)
    attn = np.asarray(attn_fwd_s, dtype=np.float64)
    fwd = np.maximum(0.0, lat + block / bw - attn / cp)
    bwd = np.maximum(0.0, lat + 2 * block / bw - 2 * attn / cp)
    steps = np.maximum(cp - 1, 0.0)
    return np.where(cp > 1, steps * (fwd * np.where(full_recompute, 2.0, 1.0) + bwd), 0.0)
