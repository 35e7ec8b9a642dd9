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

# Bytes per parameter (weights, gradients, optimizer states) for mixed-precision Adam.
# "megatron": bf16 weights, fp32 gradient accumulation buffer (main_grad), fp32 master weights
# + Adam m + v = 2 + 4 + 12 = 18 (Megatron-LM, Korthikanti et al. 2022).
# "zero": bf16 weights, bf16 gradients, fp32 master + m + v = 2 + 2 + 12 = 16 (ZeRO paper, K=12).
STATE_BYTES: dict[str, tuple[int, int, int]] = {"megatron": (2, 4, 12), "zero": (2, 2, 12)}


@dataclass(frozen=True)
class Workload:
    """Training job: sequence length, global batch in sequences, numerics and software traits."""

    seq_len: int = 4096
    global_batch: int = 1024
    precision: Precision = "bf16"
    optimizer: str = "adam"
    flash_attention: bool = True  # fused attention: no s² activations, causal half the work
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
