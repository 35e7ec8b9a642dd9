"""Expert parallelism in the cost model: what MoE blocks add to memory and step time.

Layout (Megatron-Core "MoE parallel folding", arXiv:2504.14960): the dense parts are laid over
tp·cp·dp per pipeline stage as for a dense model; the experts over the same ranks folded as
etp (expert tensor parallel, fastest) × ep × edp, so edp = tp·cp·dp / (etp·ep). Each rank holds
num_experts/ep experts, each split etp ways; its expert weights, gradients and optimizer states
(ZeRO over edp) are `expert_params_per_rank`. ParallelPlan keeps Megatron's ep | dp·cp.

Per MoE block and micro-batch on one rank:
- routed GEMMs: every rank processes 1/(tp·cp) of the stage's token-expert pairs however ep
  and etp fold them, 2·top_k·(expert weights)·tokens/t FLOPs forward, slowed by the load
  imbalance factor (the busiest expert's share over the mean; 1.0 for force-balanced
  benchmarks) and run at `GROUPED_GEMM_EFFICIENCY` × the dense GEMM efficiency;
- dispatch and combine of the tokens to the experts' ranks: `llmopt.plan.dispatch` (per
  dispatcher, with A2A overlap and DualPipe);
- permute/unpermute copies of the dispatched tokens as memory-bound traffic;
- the local experts' weight traffic per micro-batch (`expert_weight_seconds`): it does not
  shrink with the tokens per expert, so small expert GEMMs fall towards the memory roofline;
- host launches: the dispatcher's device-to-host sync of per-expert token counts empties the
  GPU queue, so each local expert's GEMM, activation (and FP8 quantisation) kernels cost the
  longer of their launches and their GPU time, and the block's router/permute/dispatch kernels
  are launch-bound (`host_seconds_per_block`). This is what makes small-expert models at micro-batch 1 slow:
  Megatron-Bridge's Qwen3-30B-A3B runs at 9.3k tokens/s/GPU on B200 with MBS=1 but 29.5k on
  B300 with MBS=8 (same table), a per-micro-batch cost rather than a per-token one.
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import mlp_params, n_mlp, num_moe_layers
from llmopt.plan.dispatch import ep_of
from llmopt.plan.grid import Grid
from llmopt.plan.workload import Workload

# Grouped (per-expert) GEMMs reach this fraction of the large dense GEMMs' throughput: many
# smaller matrices, ragged token counts per expert (TE / CUTLASS grouped GEMM).
GROUPED_GEMM_EFFICIENCY = 0.8
ACT_BYTES = 2
# Host time to launch one kernel from eager PyTorch + Transformer Engine modules (~10 us of
# PyTorch dispatch plus the module's Python): an engineering estimate, not fitted per row.
LAUNCH_S = 25e-6
# Kernels per local expert per micro-batch, forward + backward: fc1, activation, fc2 forward;
# four weight/input-gradient GEMMs and the activation backward; FP8 adds a quantisation of each
# GEMM input (2 forward, 4 backward).
KERNELS_PER_EXPERT = {"bf16": 8, "fp8": 14}
# Per MoE block and micro-batch, whatever the expert count: router GEMM, softmax/top-k, aux
# loss, permute, dispatch, combine, unpermute, forward and backward.
KERNELS_PER_MOE_BLOCK = 40


def moe_fraction(model: ModelConfig) -> float:
    return num_moe_layers(model) / model.num_layers


def expert_params_per_rank(model: ModelConfig, grid: Grid) -> np.ndarray:
    """Routed-expert weights of one block (averaged over the blocks) held by one rank."""
    ep, etp = ep_of(grid)
    return mlp_params(model)["experts"] / (ep * etp).astype(np.float64)


def expert_dp(grid: Grid) -> np.ndarray:
    """Ranks the expert weights are replicated over (ZeRO shards expert states over these)."""
    ep, etp = ep_of(grid)
    return np.maximum(grid["tp"] * grid["cp"] * grid["dp"] // (ep * etp), 1)


def expert_reasons(model: ModelConfig, grid: Grid) -> list[tuple[str, np.ndarray]]:
    """Structural rules of expert parallelism, each with its one-line reason."""
    ep, etp = ep_of(grid)
    tp, cp, dp = grid["tp"], grid["cp"], grid["dp"]
    if model.moe is None:
        return [(f"ep={{ep}} and etp={{etp}} need a MoE model; {model.name} is dense",
                 (ep > 1) | (etp > 1))]  # fmt: skip
    e = model.moe.num_experts
    return [
        (f"ep={{ep}} does not divide num_experts={e}", e % ep != 0),
        # megatron/core/parallel_state.py (initialize_model_parallel): the expert grid is
        # etp x ep x edp over the same tp·cp·dp ranks of a pipeline stage ("parallel folding")
        (
            "etp*ep={etp}*{ep} does not divide tp*cp*dp={tp}*{cp}*{dp} (experts are folded over "
            "the ranks of a pipeline stage)",
            (tp * cp * dp) % (etp * ep) != 0,
        ),  # fmt: skip
        ("etp={etp} must be 1 or tp={tp}", (etp != 1) & (etp != tp)),
    ]


def expert_options(model: ModelConfig, tp: int, dpcp: int, options) -> list[tuple[int, int]]:
    """(ep, etp) candidates of the search: etp 1 or tp, ep dividing the expert count and
    tp·dp·cp/etp (Megatron-Core's folding; dense models: (1, 1)); `options(key, default)`
    applies the user's constraints."""
    if model.moe is None:
        return [(e, t) for e in options("ep", [1]) for t in options("etp", [1])]
    out = []
    for t in options("etp", sorted({1, tp})):
        stage = tp * dpcp // t if (tp * dpcp) % t == 0 else 0
        eps = [e for e in _divisors(stage) if model.moe.num_experts % e == 0] if stage else []
        out += [(e, t) for e in options("ep", eps) if e > 1 or t == 1]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def routed_gemm_params(model: ModelConfig, work: Workload) -> float:
    """Routed-expert weights one token's GEMMs use per block (averaged over blocks), in units
    of dense-GEMM time: × load imbalance / grouped-GEMM efficiency."""
    active = mlp_params(model)["active"]
    return active * work.expert_imbalance / GROUPED_GEMM_EFFICIENCY


def expert_weight_seconds(
    model: ModelConfig, grid: Grid, grad_bytes: int, hbm_bytes_per_s: float
) -> np.ndarray:
    """HBM time per block and micro-batch (averaged over blocks) of the local experts' weight
    traffic: the forward and the input-gradient GEMMs each read the bf16 weights, the weight-
    gradient GEMM accumulates into the gradient buffer (read + write). It does not shrink with
    the tokens per expert (tokens·top_k·ep/num_experts), so small expert GEMMs fall towards
    the memory roofline: many small experts at micro-batch 1 run far below peak."""
    return expert_params_per_rank(model, grid) * (2 * ACT_BYTES + 2 * grad_bytes) / hbm_bytes_per_s


def moe_elementwise(model: ModelConfig) -> float:
    """bf16 elements per token moved by MoE-only memory-bound kernels per block (averaged):
    permute and unpermute read and write top_k copies of h, the experts' SwiGLU (3 per f)."""
    if model.moe is None:
        return 0.0
    m = model.moe
    act = (3 if n_mlp(model) == 3 else 4) * (m.top_k * m.expert_ffn_hidden)
    act += (3 if n_mlp(model) == 3 else 4) * m.shared_experts * m.shared_hidden
    return moe_fraction(model) * (4 * m.top_k * model.hidden_size + act)


def host_seconds_per_block(
    model: ModelConfig, work: Workload, grid: Grid, expert_gpu_s: np.ndarray
) -> np.ndarray:
    """Host-launch time of one MoE block per micro-batch, forward and backward, that the GPU
    work cannot hide (averaged over blocks; 0 for dense models). After the dispatcher's
    device-to-host sync the GPU queue is empty, so each expert kernel costs the longer of its
    launch and its run: the expert kernels' launches hide only behind the expert GEMMs
    (`expert_gpu_s`, the block's routed-expert GEMM seconds), and the block's own small kernels
    (router, permute, dispatch, combine) are launch-bound."""
    ep, _ = ep_of(grid)
    if model.moe is None:
        return np.zeros(len(grid["tp"]))
    local = model.moe.num_experts / ep.astype(np.float64)
    experts = moe_fraction(model) * local * KERNELS_PER_EXPERT[work.precision] * LAUNCH_S
    block = moe_fraction(model) * KERNELS_PER_MOE_BLOCK * LAUNCH_S
    return block + np.maximum(0.0, experts - expert_gpu_s)


def moe_activation_bytes(
    model: ModelConfig, tokens: np.ndarray, tp: np.ndarray, act_bytes: int = ACT_BYTES
) -> np.ndarray:
    """Bytes a MoE block keeps for backward beyond a dense block of `intermediate_size`
    (averaged over blocks): the experts' MLP intermediates for top_k (+ shared) experts
    instead of the dense MLP's, the dispatched and the combined top_k copies of h."""
    if model.moe is None:
        return np.zeros_like(tokens, dtype=np.float64)
    m = model.moe
    per_f = 3 if n_mlp(model) == 3 else 2
    experts = per_f * (m.top_k * m.expert_ffn_hidden + m.shared_experts * m.shared_hidden)
    dense = per_f * model.intermediate_size
    copies = 2 * m.top_k * model.hidden_size
    t = np.asarray(tp, dtype=np.float64)
    return moe_fraction(model) * tokens * act_bytes * ((experts - dense) / t + copies / t)
