"""FLOPs of a training step: the one definition of the MFU numerator, shared by the planner,
the trainer and the benchmarks.

Convention (model FLOPs): Megatron's 72·B·s·l·h²·(1 + s/6h + V/12lh) generalised to GQA and
SwiGLU, i.e. per token and layer forward 2·(matmul parameters) + 4·s·(heads·head_dim) for
attention scores and values (full s², no causal halving, as Megatron and torchtitan count), plus
2·h·V for the output layer; backward costs twice the forward. Hardware FLOPs (HFU) add the
recomputed forward. Pure Python: importing it never imports torch.
"""

from __future__ import annotations

from typing import Protocol

from llmopt.models.config import ModelConfig


class Workload(Protocol):
    """What FLOP counting reads of a `llmopt.plan.workload.Workload` (a protocol, so this
    module does not import the workload module, which re-exports these functions)."""

    seq_len: int

    @property
    def tokens_per_step(self) -> int: ...


def matmul_params_per_layer(model: ModelConfig) -> int:
    """Weights of one block that take part in GEMMs (QKV, output, MLP)."""
    h = model.hidden_size
    n_mlp = 3 if model.mlp_kind == "swiglu" else 2
    return (
        h * model.q_size
        + 2 * h * model.kv_size
        + model.q_size * h
        + n_mlp * h * (model.intermediate_size)
    )


def layer_flops_fwd_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one block per token: GEMMs + attention scores and values (full s²)."""
    return 2.0 * matmul_params_per_layer(model) + 4.0 * seq_len * model.q_size


def head_flops_fwd_per_token(model: ModelConfig) -> float:
    return 2.0 * model.hidden_size * model.vocab_size


def model_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token: 3 × forward of all layers and the output layer."""
    per_token = model.num_layers * layer_flops_fwd_per_token(model, seq_len)
    return 3.0 * (per_token + head_flops_fwd_per_token(model))


def model_flops_per_step(model: ModelConfig, work: Workload) -> float:
    """Model FLOPs per step (MFU numerator)."""
    return model_flops_per_token(model, work.seq_len) * work.tokens_per_step


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' dense peak."""
    if step_time_s <= 0 or num_devices <= 0 or peak_flops <= 0:
        raise ValueError(
            f"mfu needs positive step time, devices and peak (got {step_time_s}, "
            f"{num_devices}, {peak_flops})"
        )
    return flops_per_step / (step_time_s * num_devices * peak_flops)


def recompute_flops_per_step(model: ModelConfig, work: Workload, recompute: str) -> float:
    """Extra FLOPs of activation recomputation (HFU adds these)."""
    tokens = work.tokens_per_step
    if recompute == "full":
        return model.num_layers * layer_flops_fwd_per_token(model, work.seq_len) * tokens
    if recompute == "selective":  # attention core (QK^T, softmax, ·V) again
        return model.num_layers * 4.0 * work.seq_len * model.q_size * tokens
    return 0.0


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int, recompute: bool) -> float:
    """Narayanan et al. 2021 Eq. 3 (96·…·(1+s/6h+V/16lh), counts the recomputed forward) when
    `recompute`, else the model-FLOPs form 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
    if recompute:
        return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
    return 72.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
