"""Megatron-Core's selective recompute modules in the memory model: what each one stops keeping.

`--recompute-granularity selective --recompute-modules ...` (megatron/core/transformer/
transformer_config.py: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)
recomputes only the named parts of a block in backward; `--fine-grained-activation-offloading
--offload-modules ...` (expert_fc1, moe_act, core_attn, attn_proj, ...) moves the named outputs
to host memory. Either way the GPU no longer keeps those activations between forward and
backward. `Workload.recompute_modules` lists both; the planner's plain "selective" (no modules
named) keeps its own meaning (`llmopt.plan.memory.activation_bytes_per_layer`). Bytes are per
layer, micro-batch and rank, averaged over dense and MoE blocks like the rest of the model.
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import num_moe_layers
from llmopt.plan.experts import moe_activation_bytes

ACT_BYTES = 2


def dropped_bytes(
    model: ModelConfig,
    tokens: np.ndarray,
    tp: np.ndarray,
    sp: np.ndarray,
    modules: tuple[str, ...],
) -> np.ndarray:
    """Activation bytes per layer and micro-batch that the named modules stop keeping, out of
    what a block keeps without recomputation (`tokens` per rank after the CP split)."""
    t = np.asarray(tp, dtype=np.float64)
    rep = np.where(np.asarray(sp, dtype=bool), t, 1.0)
    h, f, a = model.hidden_size, model.intermediate_size, model.num_heads
    moe = model.moe
    moe_share = num_moe_layers(model) / model.num_layers if moe is not None else 0.0
    glu = model.mlp_kind == "swiglu"
    kv = np.maximum(model.num_kv_heads / t, 1.0) * model.head_dim
    per_token = np.zeros_like(t)
    for m in modules:
        if m == "layernorm":  # the two norm outputs (the QKV and MLP inputs)
            per_token = per_token + 2 * h / rep
        elif m == "core_attn":  # the fp32 log-sum-exp (flash keeps nothing else of its own)
            per_token = per_token + 4.0 * a / t / ACT_BYTES
        elif m == "mlp":  # the dense MLPs' intermediates
            per_token = per_token + (1 - moe_share) * (3 if glu else 2) * f / t
        elif m == "attn_proj":  # the attention output (the output projection's input)
            per_token = per_token + model.q_size / t
        elif m == "mla_up_proj" and model.mla is not None:  # up-projected q, k and v
            per_token = per_token + (model.q_size / t + 2 * kv)
        elif moe is not None and m in ("moe_act", "expert_fc1", "shared_experts"):
            ffn = moe.top_k * moe.expert_ffn_hidden
            shared = moe.shared_experts * moe.shared_hidden
            # moe_act recomputes the activation's output (fc2's input); offloading expert_fc1
            # moves fc1's input (the dispatched top_k copies of h) to the host
            part = {"moe_act": ffn, "expert_fc1": moe.top_k * h,
                    "shared_experts": (3 if glu else 2) * shared}[m]  # fmt: skip
            per_token = per_token + moe_share * part / t
    out = np.asarray(tokens, dtype=np.float64) * ACT_BYTES * per_token
    if moe is not None and "moe" in modules:  # the whole MoE layer, its extra copies too
        out = out + np.asarray(tokens, dtype=np.float64) * ACT_BYTES * moe_share * (
            (3 if glu else 2) * f / t
        )
        out = out + moe_activation_bytes(model, tokens, tp)
    return out
