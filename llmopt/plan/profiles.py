"""GPU, link and cluster profiles: the physics the planner's cost model runs on (the named
presets are in `catalog`, with their sources).

Every number the cost model uses is a named field here, with where its value comes from. Peaks
and bandwidths are datasheet figures; the `*_efficiency` fields are achievable fractions of those
peaks (what well-tuned kernels and NCCL reach), not per-run fudge factors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmopt.errors import UsageError

GIB = 1024**3


@dataclass(frozen=True)
class LinkProfile:
    """One class of link as seen by a single GPU (unidirectional, per GPU)."""

    name: str
    bandwidth_gbs: float  # GB/s per GPU per direction (datasheet)
    efficiency: float  # achievable NCCL bus bandwidth / datasheet bandwidth
    latency_us: float  # per-step latency of a collective over this link

    def __post_init__(self) -> None:
        _positive(self, "bandwidth_gbs", "latency_us")
        _fraction(self, "efficiency")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9 * self.efficiency


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator model. Peaks are dense (no 2:4 sparsity)."""

    name: str
    peak_bf16_tflops: float
    peak_fp8_tflops: float | None  # None: no FP8 tensor cores
    hbm_gib: float
    hbm_bandwidth_gbs: float
    # Achievable fraction of the dense peak on the large bf16 GEMMs of transformer layers.
    gemm_efficiency: float
    # Same for FP8 GEMMs (per-tensor scaled, Transformer Engine style).
    fp8_gemm_efficiency: float
    # Fraction of the bf16 peak the fused attention kernels of training reach, forward and
    # backward together, on the causal half they compute: current kernels (cuDNN as Transformer
    # Engine >= 2 runs it, FlashAttention-3). `fa2_attention_efficiency` below is the
    # FlashAttention-2 generation (`Workload.attention_kernel`).
    attention_efficiency: float
    # Fraction of HBM bandwidth reached by memory-bound elementwise kernels (norms, softmax...).
    hbm_efficiency: float
    # Fraction of a communication that can hide behind compute when the software overlaps it
    # (SM and HBM contention keep this below 1).
    comm_overlap_efficiency: float
    # HBM held by the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers outside tensors.
    runtime_reserved_gib: float
    # Fraction of HBM lost to caching-allocator fragmentation; a plan must fit in the rest.
    allocator_margin: float
    # Board power the efficiencies above were measured at (SXM TDP) and the limit it runs at.
    tdp_w: float = 700.0
    power_limit_w: float | None = None
    # FlashAttention-2-generation kernels (FlashAttention-2 itself, PyTorch SDPA's flash
    # backend, the fused attention of 2024 Transformer Engine); None: as attention_efficiency
    fa2_attention_efficiency: float | None = None

    def __post_init__(self) -> None:
        _positive(self, "peak_bf16_tflops", "hbm_gib", "hbm_bandwidth_gbs")
        if self.peak_fp8_tflops is not None and self.peak_fp8_tflops <= 0:
            raise UsageError(f"peak_fp8_tflops={self.peak_fp8_tflops} must be positive or None")
        _fraction(
            self,
            "gemm_efficiency",
            "fp8_gemm_efficiency",
            "attention_efficiency",
            "hbm_efficiency",
            "comm_overlap_efficiency",
        )
        _positive(self, "tdp_w")
        if self.fa2_attention_efficiency is not None:
            _fraction(self, "fa2_attention_efficiency")
        if self.power_limit_w is not None and not 0 < self.power_limit_w <= self.tdp_w:
            raise UsageError(
                f"power_limit_w={self.power_limit_w} must be in (0, tdp_w={self.tdp_w}]"
            )
        if not 0 <= self.allocator_margin < 0.5:
            raise UsageError(f"allocator_margin={self.allocator_margin} must be in [0, 0.5)")
        if not 0 <= self.runtime_reserved_gib < self.hbm_gib:
            raise UsageError(
                f"runtime_reserved_gib={self.runtime_reserved_gib} must be in [0, hbm_gib)"
            )

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for the GEMM precision."""
        if precision == "fp8":
            if self.peak_fp8_tflops is None:
                raise UsageError(f"{self.name} has no FP8 tensor cores; use precision=bf16")
            return self.peak_fp8_tflops * 1e12
        return self.peak_bf16_tflops * 1e12

    def attention_efficiency_of(self, kernel: str) -> float:
        """Attention efficiency of a kernel generation ("fa3" current, "fa2")."""
        if kernel == "fa2" and self.fa2_attention_efficiency is not None:
            return self.fa2_attention_efficiency
        return self.attention_efficiency

    @property
    def clock_scale(self) -> float:
        """Compute throughput under a power cap relative to TDP: dynamic power ~ f·V² with
        V ~ f, so sustained clocks scale as (limit / TDP)^(1/3). HBM bandwidth is unaffected."""
        if self.power_limit_w is None:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** (1 / 3)

    @property
    def usable_bytes(self) -> float:
        """HBM a plan may fill: total minus runtime reservations and fragmentation margin."""
        return (self.hbm_gib * (1 - self.allocator_margin) - self.runtime_reserved_gib) * GIB


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `gpus_per_node` GPUs; NVLink inside, a network between."""

    name: str
    gpu: GPUProfile
    nodes: int
    gpus_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile

    def __post_init__(self) -> None:
        for field in ("nodes", "gpus_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"{field}={value!r} must be a positive integer")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)


def _positive(obj: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise UsageError(f"{f}={v!r} must be a positive number")


def _fraction(obj: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise UsageError(f"{f}={v!r} must be a fraction in (0, 1]")
