"""FLOPs of a training step: the one definition of the MFU numerator, shared by the planner,
the trainer and the benchmarks.

Model FLOPs per trained token are 3 × forward (backward costs twice the forward). The forward
counts 2·(matmul parameters a token uses) per layer — GQA or MLA attention projections, the dense
MLP or, in MoE blocks, the router, the top_k routed and the shared experts — plus the attention
core and 2·h·V for the output layer (and DeepSeek-V3's MTP modules). `FLOPS_CONVENTIONS` names
how the attention core is counted:

- "causal" (default): the unmasked half, s·heads·(d_qk + d_v) per token forward, which is
  what flash attention computes and what the planner times (MFU then cannot exceed 100%);
- "megatron": the full s², 2·s·heads·(d_qk + d_v) — Narayanan et al. 2021 Eq. 3 (without its
  recompute term) and Korthikanti et al. 2022, i.e. 72·B·s·l·h²·(1 + s/6h + V/12lh) for GPT;
- "palm": PaLM's 6·N + 12·L·H·Q·T per token (Chowdhery et al. 2022, App. B), N the active
  parameters without the input embedding; torchtitan reports this.
Hardware FLOPs (HFU) add the recomputed forward. Pure Python: importing it never imports torch.
"""

from __future__ import annotations

from typing import Protocol

from llmopt.errors import LlmoptError, UsageError
from llmopt.models.config import ModelConfig
from llmopt.models.moe import (
    attention_core_dim,
    attention_params,
    mlp_params,
    mtp_block_params,
    parameter_counts,
)

FLOPS_CONVENTIONS = ("causal", "megatron", "palm")


class FlopsConventionError(LlmoptError, ValueError):
    """A FLOP-counting convention that does not exist."""


def _check(convention: str) -> None:
    if convention not in FLOPS_CONVENTIONS:
        raise FlopsConventionError(
            f"flops convention {convention!r} is unknown; choose from {', '.join(FLOPS_CONVENTIONS)}"
        )


class Workload(Protocol):
    """What FLOP counting reads of a `llmopt.plan.workload.Workload` (a protocol, so this
    module does not import the workload module, which re-exports these functions)."""

    seq_len: int

    @property
    def tokens_per_step(self) -> int: ...


def matmul_params_per_layer(model: ModelConfig) -> float:
    """Weights of one block a token's GEMMs use (attention projections, MLP; for MoE the router,
    top_k routed and the shared experts), averaged over dense and MoE blocks."""
    mp = mlp_params(model)
    return attention_params(model) + mp["dense"] + mp["active"] + mp["shared"] + mp["router"]


def attention_flops_fwd_per_token(model: ModelConfig, seq_len: int, convention: str) -> float:
    """Attention-core (QKᵀ and ·V) forward FLOPs per token and layer under `convention`."""
    _check(convention)
    full = 2.0 * seq_len * attention_core_dim(model)
    return 0.5 * full if convention == "causal" else full


def layer_flops_fwd_per_token(
    model: ModelConfig, seq_len: int, convention: str = "causal"
) -> float:
    """Forward FLOPs of one block per token: GEMMs + attention core (module docstring)."""
    attn = attention_flops_fwd_per_token(model, seq_len, convention)
    return 2.0 * matmul_params_per_layer(model) + attn


def head_flops_fwd_per_token(model: ModelConfig) -> float:
    return 2.0 * model.hidden_size * model.vocab_size


def _mtp_layers(model: ModelConfig) -> int:
    return model.moe.mtp_layers if model.moe is not None else 0


def model_flops_per_token(model: ModelConfig, seq_len: int, convention: str = "causal") -> float:
    """Model FLOPs per trained token: 3 × forward of all layers and the output layer (each MTP
    module one more MoE block and output layer), or PaLM's 6N + 12·L·H·Q·T."""
    _check(convention)
    mtp = _mtp_layers(model)
    if convention == "palm":
        n = parameter_counts(model)["active"] - model.vocab_size * model.hidden_size
        n += mtp * model.vocab_size * model.hidden_size  # each MTP module runs the head again
        blocks = model.num_layers + mtp
        return 6.0 * n + 3.0 * blocks * attention_flops_fwd_per_token(model, seq_len, "megatron")
    per_token = model.num_layers * layer_flops_fwd_per_token(model, seq_len, convention)
    if mtp:  # each MTP module: one more MoE block, its 2h->h projection, the output layer
        attn = attention_flops_fwd_per_token(model, seq_len, convention)
        per_token += mtp * (2.0 * mtp_block_params(model) + attn + head_flops_fwd_per_token(model))
    return 3.0 * (per_token + head_flops_fwd_per_token(model))


def model_flops_per_step(
    model: ModelConfig, work: Workload, convention: str | None = None
) -> float:
    """Model FLOPs per step (MFU numerator), in `convention` (default: the workload's)."""
    conv = convention or getattr(work, "flops_convention", "causal")
    return model_flops_per_token(model, work.seq_len, conv) * work.tokens_per_step


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' dense peak."""
    if step_time_s <= 0 or num_devices <= 0 or peak_flops <= 0:
        raise UsageError(
            f"mfu needs positive step time, devices and peak (got {step_time_s}, "
            f"{num_devices}, {peak_flops})"
        )
    return flops_per_step / (step_time_s * num_devices * peak_flops)


def recompute_flops_per_step(model: ModelConfig, work: Workload, recompute: str) -> float:
    """Extra FLOPs of activation recomputation (HFU adds these), with the attention core counted
    as the workload's convention counts it (PaLM's full s² for "palm")."""
    conv = getattr(work, "flops_convention", "causal")
    conv = "megatron" if conv == "palm" else conv
    tokens = work.tokens_per_step
    if recompute == "full":
        return model.num_layers * layer_flops_fwd_per_token(model, work.seq_len, conv) * tokens
    if recompute == "selective":  # attention core (QK^T, softmax, ·V) again
        attn = attention_flops_fwd_per_token(model, work.seq_len, conv)
        return model.num_layers * attn * tokens
    return 0.0


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int, recompute: bool) -> float:
    """Narayanan et al. 2021 Eq. 3 (96·…·(1+s/6h+V/16lh), counts the recomputed forward) when
    `recompute`, else the model-FLOPs form 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
    if recompute:
        return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
    return 72.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
