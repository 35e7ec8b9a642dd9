"""What is trained (the workload). How it is mapped is a `llmopt.parallel.plan.ParallelPlan`
(`llmopt.plan.grid` for batches of them); FLOPs are in `llmopt.plan.flops`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig  # noqa: F401  (re-exported for type hints)
from llmopt.parallel.plan import RECOMPUTES, SCHEDULES  # noqa: F401  (re-exported)
from llmopt.plan.flops import (  # noqa: F401  (re-exported)
    FLOPS_CONVENTIONS,
    head_flops_fwd_per_token,
    layer_flops_fwd_per_token,
    matmul_params_per_layer,
    megatron_flops,
    model_flops_per_step,
    recompute_flops_per_step,
)

Precision = Literal["bf16", "fp8"]  # what the cost model prices (ParallelPlan also has fp32)
# Fused attention kernel generations (`GPUProfile.attention_efficiency_of`): "fa3" = current
# Hopper/Blackwell kernels (cuDNN as Transformer Engine >= 2 runs it, FlashAttention-3), "fa2" =
# FlashAttention-2 and its contemporaries (PyTorch SDPA's flash backend, 2024 TE fused attention).
ATTENTION_KERNELS = ("fa3", "fa2")
# What "selective" recomputation recomputes with fused attention (`Workload.selective`):
# "memory-bound" = the norms, activation function and other memory-bound ops (Megatron-Core's
# selective modules); "every-other-mm" = torchtitan's op-level SAC, which saves the outputs of
# every compute op except every second matmul of a block, so those GEMMs run again too
# (torchtitan parallelize_llama.py @9dec370, _apply_ac_to_transformer_block).
SELECTIVE_POLICIES = ("memory-bound", "every-other-mm")
# How FP8 GEMM inputs are quantised (`Workload.fp8_casts`): "fused" = inside the kernels that
# produce them (Transformer Engine's LayerNormLinear, its activation kernels); "torchao" =
# torchao Float8Linear's dynamic scaling, an amax pass and a cast (and a transposed cast for the
# backward) of every linear's input and output gradient, as separate memory-bound kernels.
FP8_CASTS = ("fused", "torchao")

# Bytes per parameter (weights, gradients, optimizer states) for mixed-precision Adam.
# "megatron": bf16 weights, fp32 gradient accumulation buffer (main_grad), fp32 master weights
# + Adam m + v = 2 + 4 + 12 = 18 (Megatron-LM, Korthikanti et al. 2022).
# "zero": bf16 weights, bf16 gradients, fp32 master + m + v = 2 + 2 + 12 = 16 (ZeRO paper, K=12).
STATE_BYTES: dict[str, tuple[int, int, int]] = {"megatron": (2, 4, 12), "zero": (2, 2, 12)}
# Adam moments m and v in bf16 instead of fp32 (`Workload.moments`): 4 bytes less each, so the
# optimizer states are fp32 master + 2 + 2 = 8 bytes per parameter (DeepSeek-V3 report §3.3.3;
# Megatron-Core's --use-precision-aware-optimizer --exp-avg-dtype/--exp-avg-sq-dtype bf16).
MOMENT_DTYPES = ("fp32", "bf16")
# Megatron-Core's --recompute-modules and --offload-modules names (`llmopt.plan.recompute`)
RECOMPUTE_MODULES = (
    "core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts", "mla_up_proj",
    "expert_fc1", "attn_proj",
)  # fmt: skip


def optimizer_bytes_per_param(moments: str) -> int:
    """Optimizer-state bytes per parameter: fp32 master weights + Adam's m and v."""
    return 4 + 2 * (4 if moments == "fp32" else 2)


@dataclass(frozen=True)
class Workload:
    """Training job: sequence length, global batch in sequences, numerics and software traits."""

    seq_len: int = 4096
    global_batch: int = 1024
    precision: Precision = "bf16"
    optimizer: str = "adam"
    flash_attention: bool = True  # fused attention: no s² activations, causal half the work
    attention_kernel: str = "fa3"  # which generation of fused kernel (ATTENTION_KERNELS)
    selective: str = "memory-bound"  # what selective recomputation reruns (SELECTIVE_POLICIES)
    fp8_casts: str = "fused"  # where FP8 inputs are quantised (FP8_CASTS)
    # ZeRO/FSDP weight all-gathers carry FP8 weights (1 byte; torchtitan's float8 all-gather,
    # Megatron's --fp8-param-gather); only with precision="fp8"
    fp8_param_gather: bool = False
    moments: str = "fp32"  # Adam moment dtype (MOMENT_DTYPES)
    # What "selective" recompute (or activation offloading) stops keeping, by Megatron-Core
    # module name (RECOMPUTE_MODULES); empty: the planner's own selective (`selective`)
    recompute_modules: tuple[str, ...] = ()
    dropout: bool = False  # GPT-style dropout (masks count toward activation memory)
    state_bytes: str = "megatron"
    tp_comm_overlap: bool = False  # TP collectives overlapped with GEMMs (TE userbuffers)
    dp_comm_overlap: bool = True  # gradient reduce overlapped with backward (bucketed)
    # Fused elementwise kernels (Megatron/TE, torch.compile). False: eager PyTorch, where an
    # fp32-upcasting RMSNorm, complex-number RoPE and unfused SwiGLU move several times the bytes.
    fused_kernels: bool = True
    # Pipeline messages without SP split over the TP ranks and re-gathered over NVLink
    # (Narayanan et al. 2021 §4.1, Megatron-LM's default until Megatron-Core).
    pp_scatter_gather: bool = False
    # How MFU counts the attention core (`llmopt.plan.flops.FLOPS_CONVENTIONS`).
    flops_convention: str = "causal"
    # MoE: the busiest expert's tokens over the mean (1.0 = balanced, as force-balanced
    # benchmarks run); EP all-to-alls hidden behind compute (DeepEP / 1F1B A2A overlap).
    expert_imbalance: float = 1.0
    ep_comm_overlap: bool = False
    # MoE token dispatcher (`llmopt.plan.dispatch.DISPATCHERS`): NCCL all-to-all, or DeepEP /
    # HybridEP, which cross the network once per destination node
    ep_dispatcher: str = "alltoall"
    # DeepSeek's DualPipe schedule (bidirectional 1F1B): half the bubble, two copies of the
    # stage's weights, dispatch/combine hidden behind the paired micro-batch's compute
    dualpipe: bool = False
    # Data-parallel sharding implementation (`llmopt.plan.timing.SHARDING_OVERLAP`): "fsdp"
    # (FSDP2, Megatron's distributed optimizer / Megatron-FSDP) or "deepspeed" (ZeRO-3 hooks)
    sharding: str = "fsdp"
    # Fine-tuning (llmopt.plan.memory.lora_model_states): LoRA adapters of this rank on every
    # block linear train; the frozen base is bf16, or packed INT4 with qlora.
    lora_rank: int = 0
    qlora: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UsageError(f"{name}={v!r} must be a positive integer")
        if self.precision not in ("bf16", "fp8"):
            raise UsageError(f"precision={self.precision!r} is not supported; use bf16 or fp8")
        if self.flops_convention not in FLOPS_CONVENTIONS:
            raise UsageError(
                f"flops_convention={self.flops_convention!r}; choose from "
                + ", ".join(FLOPS_CONVENTIONS)
            )
        imb = self.expert_imbalance
        if isinstance(imb, bool) or not isinstance(imb, int | float) or not math.isfinite(imb):
            raise UsageError(f"expert_imbalance={imb!r} must be a finite number >= 1")
        if imb < 1:
            raise UsageError(f"expert_imbalance={imb!r} must be >= 1 (busiest over mean load)")
        if self.ep_dispatcher not in ("alltoall", "deepep", "hybridep"):
            raise UsageError(
                f"ep_dispatcher={self.ep_dispatcher!r}; choose from alltoall, deepep, hybridep"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise UsageError(
                f"attention_kernel={self.attention_kernel!r}; choose from "
                + ", ".join(ATTENTION_KERNELS)
            )
        checks = (("selective", SELECTIVE_POLICIES), ("fp8_casts", FP8_CASTS))
        for name, valid in (*checks, ("moments", MOMENT_DTYPES)):
            if getattr(self, name) not in valid:
                raise UsageError(f"{name}={getattr(self, name)!r}; choose from {', '.join(valid)}")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad:
            raise UsageError(
                f"recompute_modules {', '.join(bad)}; choose from {', '.join(RECOMPUTE_MODULES)}"
            )
        if self.sharding not in ("fsdp", "deepspeed"):
            raise UsageError(f"sharding={self.sharding!r}; choose fsdp or deepspeed")
        if self.optimizer != "adam":
            raise UsageError(f"optimizer={self.optimizer!r} is not supported; use adam")
        if (
            isinstance(self.lora_rank, bool)
            or not isinstance(self.lora_rank, int)
            or (self.lora_rank < 0)
        ):
            raise UsageError(f"lora_rank={self.lora_rank!r} must be a non-negative integer")
        if self.qlora and not self.lora_rank:
            raise UsageError("qlora=True needs lora_rank > 0 (adapters on the INT4 base)")
        if self.state_bytes not in STATE_BYTES:
            raise UsageError(
                f"state_bytes={self.state_bytes!r}; choose from {', '.join(STATE_BYTES)}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch
