"""What is trained (workload) and how it is mapped (parallel config). FLOPs: `llmopt.plan.flops`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import numpy as np

from llmopt.models.config import ModelConfig  # noqa: F401  (re-exported for type hints)
from llmopt.plan.flops import (  # noqa: F401  (re-exported)
    head_flops_fwd_per_token,
    layer_flops_fwd_per_token,
    matmul_params_per_layer,
    megatron_flops,
    model_flops_per_step,
    recompute_flops_per_step,
)

Precision = Literal["bf16", "fp8"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")

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

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"precision={self.precision!r} is not supported; use bf16 or fp8")
        if self.optimizer != "adam":
            raise ValueError(f"optimizer={self.optimizer!r} is not supported; use adam")
        if self.state_bytes not in STATE_BYTES:
            raise ValueError(
                f"state_bytes={self.state_bytes!r}; choose from {', '.join(STATE_BYTES)}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class ParallelConfig:
    """One mapping of the job onto the cluster (Megatron rank order: tp, cp, dp, pp)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sp: bool = False
    zero_stage: int = 0
    micro_batch: int = 1
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "micro_batch", "num_microbatches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; choose from {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"recompute={self.recompute!r}; choose from {', '.join(RECOMPUTES)}")
        if self.schedule == "interleaved" and (self.virtual_stages < 2 or self.pp < 2):
            raise ValueError(
                f"schedule=interleaved needs pp>=2 and virtual_stages>=2 "
                f"(got pp={self.pp}, virtual_stages={self.virtual_stages})"
            )
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule=interleaved "
                f"(got {self.schedule})"
            )
        if self.sp and self.tp == 1:
            raise ValueError("sp=True (sequence parallel) needs tp>1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def to_grid(self) -> Grid:
        return {
            "tp": np.array([self.tp]),
            "pp": np.array([self.pp]),
            "dp": np.array([self.dp]),
            "cp": np.array([self.cp]),
            "sp": np.array([int(self.sp)]),
            "zero": np.array([self.zero_stage]),
            "mb": np.array([self.micro_batch]),
            "m": np.array([self.num_microbatches]),
            "v": np.array([self.virtual_stages]),
            "sched": np.array([SCHEDULES.index(self.schedule)]),
            "rc": np.array([RECOMPUTES.index(self.recompute)]),
        }

    def short(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        return ",".join(parts)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# A grid is a batch of parallel configs as parallel numpy arrays (same keys as `to_grid`), so
# the cost model evaluates one config or a million with the same code.
Grid = dict[str, np.ndarray]


def grid_row(grid: Grid, i: int) -> ParallelConfig:
    """The i-th config of a grid."""
    return ParallelConfig(
        tp=int(grid["tp"][i]),
        pp=int(grid["pp"][i]),
        dp=int(grid["dp"][i]),
        cp=int(grid["cp"][i]),
        sp=bool(grid["sp"][i]),
        zero_stage=int(grid["zero"][i]),
        micro_batch=int(grid["mb"][i]),
        num_microbatches=int(grid["m"][i]),
        schedule=SCHEDULES[int(grid["sched"][i])],  # type: ignore[arg-type]
        virtual_stages=int(grid["v"][i]),
        recompute=RECOMPUTES[int(grid["rc"][i])],  # type: ignore[arg-type]
    )
