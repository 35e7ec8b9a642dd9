"""GPU, link and cluster profiles: the physics the planner's cost model runs on.

Every number the cost model uses is a named field here, with where its value comes from. Peaks
and bandwidths are datasheet figures; the `*_efficiency` fields are achievable fractions of those
peaks (what well-tuned kernels and NCCL reach), not per-run fudge factors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    # Fraction of peak reached by the fused attention kernel (FlashAttention fwd+bwd average).
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

    def __post_init__(self) -> None:
        _positive(self, "peak_bf16_tflops", "hbm_gib", "hbm_bandwidth_gbs")
        if self.peak_fp8_tflops is not None and self.peak_fp8_tflops <= 0:
            raise ValueError(f"peak_fp8_tflops={self.peak_fp8_tflops} must be positive or None")
        _fraction(
            self,
            "gemm_efficiency",
            "fp8_gemm_efficiency",
            "attention_efficiency",
            "hbm_efficiency",
            "comm_overlap_efficiency",
        )
        _positive(self, "tdp_w")
        if self.power_limit_w is not None and not 0 < self.power_limit_w <= self.tdp_w:
            raise ValueError(
                f"power_limit_w={self.power_limit_w} must be in (0, tdp_w={self.tdp_w}]"
            )
        if not 0 <= self.allocator_margin < 0.5:
            raise ValueError(f"allocator_margin={self.allocator_margin} must be in [0, 0.5)")
        if not 0 <= self.runtime_reserved_gib < self.hbm_gib:
            raise ValueError(
                f"runtime_reserved_gib={self.runtime_reserved_gib} must be in [0, hbm_gib)"
            )

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for the GEMM precision."""
        if precision == "fp8":
            if self.peak_fp8_tflops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores; use precision=bf16")
            return self.peak_fp8_tflops * 1e12
        return self.peak_bf16_tflops * 1e12

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
                raise ValueError(f"{field}={value!r} must be a positive integer")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)


def _positive(obj: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{f}={v!r} must be a positive number")


def _fraction(obj: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"{f}={v!r} must be a fraction in (0, 1]")


# ---- presets ---------------------------------------------------------------------------------
# Peaks: NVIDIA datasheets (A100: 312 bf16 dense; H100 SXM: 989 bf16 / 1979 fp8 dense;
# H200: same silicon as H100 with 141 GB HBM3e at 4.8 TB/s; B200 (DGX B200): 2250 bf16 /
# 4500 fp8 dense, 180 GB at 8 TB/s). HBM sizes are in the units the datasheets use (GB), which
# the allocator sees as slightly less than that many GiB: A100/H100 80 GB boards expose 79.2 GiB.
#
# Efficiencies:
# - gemm_efficiency: fraction of the dense peak that the GEMMs of a full training step sustain
#   (power/clock limits under all-SM load, per-rank shapes after TP, SMs taken by NCCL).
#   A100 0.74: cuBLAS reaches ~0.8-0.85 of 312 on large bf16 GEMMs in isolation; 0.74 puts the
#   Megatron A100 runs of Narayanan 2021 / Korthikanti 2022 (one GPU type, 30 rows, 3 mappings
#   families) at a median error of ~5 %. H100 0.55 (~545 TFLOP/s): fitted to the one fused-kernel
#   H100 row in the public anchors (Megatron-LM 1.7B, 41 % MFU) and consistent with Llama 3
#   405B's 38-43 % MFU (Dubey et al. 2024, Table 4) evaluated at its published mapping; H100
#   microbenchmarks reach 0.65-0.75 only in isolation. B200 assumed like H100 (no public data).
# - fp8_gemm_efficiency: per-tensor-scaled FP8 GEMMs including cast/amax kernels deliver ~1.5x
#   the bf16 GEMM throughput in Transformer Engine benchmarks: 0.42 of the FP8 peak.
# - attention_efficiency: FlashAttention-2 reaches 50-73 % of A100 peak forward and ~45-60 %
#   forward+backward (Dao 2023, Fig. 4-6); FlashAttention-2 on H100 ~35-40 % of peak (FA3 paper,
#   Shah et al. 2024, baseline); FA3 reaches 0.6-0.75 on H100.
# - hbm_efficiency: STREAM-like copy kernels reach ~0.8-0.9 of HBM peak on A100/H100.
# - link efficiency: nccl-tests busbw / line rate; A100 NVLink3 ~230 of 300 GB/s, H100 NVLink4
#   ~360-370 of 450 GB/s; InfiniBand HDR/NDR busbw ~0.8 of line rate for large messages.
A100_80GB = GPUProfile(
    name="A100-SXM4-80GB",
    peak_bf16_tflops=312.0,
    peak_fp8_tflops=None,
    hbm_gib=79.2,
    hbm_bandwidth_gbs=2039.0,
    gemm_efficiency=0.74,
    fp8_gemm_efficiency=0.74,
    attention_efficiency=0.5,
    hbm_efficiency=0.8,
    comm_overlap_efficiency=0.8,
    runtime_reserved_gib=1.5,
    allocator_margin=0.05,
    tdp_w=400.0,
)
H100_SXM = GPUProfile(
    name="H100-SXM5-80GB",
    peak_bf16_tflops=989.0,
    peak_fp8_tflops=1979.0,
    hbm_gib=79.2,
    hbm_bandwidth_gbs=3350.0,
    gemm_efficiency=0.55,
    fp8_gemm_efficiency=0.42,
    attention_efficiency=0.4,
    hbm_efficiency=0.8,
    comm_overlap_efficiency=0.8,
    runtime_reserved_gib=1.5,
    allocator_margin=0.05,
)
H200_SXM = dataclasses.replace(
    H100_SXM, name="H200-SXM-141GB", hbm_gib=131.0, hbm_bandwidth_gbs=4800.0
)
B200 = GPUProfile(
    name="B200-180GB",
    peak_bf16_tflops=2250.0,
    peak_fp8_tflops=4500.0,
    hbm_gib=167.0,
    hbm_bandwidth_gbs=8000.0,
    gemm_efficiency=0.55,
    fp8_gemm_efficiency=0.42,
    attention_efficiency=0.4,
    hbm_efficiency=0.8,
    comm_overlap_efficiency=0.8,
    runtime_reserved_gib=2.0,
    allocator_margin=0.05,
    tdp_w=1000.0,
)

NVLINK3 = LinkProfile("NVLink3 (NVSwitch)", bandwidth_gbs=300.0, efficiency=0.77, latency_us=8.0)
NVLINK4 = LinkProfile("NVLink4 (NVSwitch)", bandwidth_gbs=450.0, efficiency=0.8, latency_us=8.0)
NVLINK5 = LinkProfile("NVLink5 (NVSwitch)", bandwidth_gbs=900.0, efficiency=0.8, latency_us=8.0)
IB_HDR = LinkProfile(
    "InfiniBand HDR 200Gb/s per GPU", bandwidth_gbs=25.0, efficiency=0.8, latency_us=15
)
IB_NDR = LinkProfile(
    "InfiniBand NDR 400Gb/s per GPU", bandwidth_gbs=50.0, efficiency=0.8, latency_us=15
)

CLUSTER_PRESETS: dict[str, tuple[GPUProfile, LinkProfile, LinkProfile]] = {
    "dgx-a100-80gb": (A100_80GB, NVLINK3, IB_HDR),
    "dgx-h100": (H100_SXM, NVLINK4, IB_NDR),
    "dgx-h200": (H200_SXM, NVLINK4, IB_NDR),
    "dgx-b200": (B200, NVLINK5, IB_NDR),
}
CLUSTER_ALIASES = {
    "a100": "dgx-a100-80gb",
    "h100": "dgx-h100",
    "h200": "dgx-h200",
    "b200": "dgx-b200",
}


def get_cluster(name: str, nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
    """A preset cluster of `nodes` DGX-style nodes."""
    key = CLUSTER_ALIASES.get(name.lower(), name.lower())
    if key not in CLUSTER_PRESETS:
        raise ValueError(
            f"unknown cluster {name!r}; known: {', '.join(CLUSTER_PRESETS)} "
            f"(aliases {', '.join(CLUSTER_ALIASES)}) or a TOML file"
        )
    gpu, nvl, net = CLUSTER_PRESETS[key]
    return Cluster(key, gpu, nodes, gpus_per_node, nvl, net)


def customize(cluster: Cluster, **overrides: Any) -> Cluster:
    """Override GPU/link fields by name: `gpu.<field>`, `intra_node.<field>`, `inter_node.<field>`,
    or a top-level field (`nodes`, `gpus_per_node`)."""
    gpu, intra, inter = {}, {}, {}
    top: dict[str, Any] = {}
    targets = {"gpu": (gpu, GPUProfile), "intra_node": (intra, LinkProfile)}
    targets["inter_node"] = (inter, LinkProfile)
    for key, value in overrides.items():
        if value is None:
            continue
        part, _, field = key.partition(".")
        if field:
            if part not in targets:
                raise ValueError(f"unknown cluster section {part!r}; valid: {', '.join(targets)}")
            store, cls = targets[part]
            names = {f.name for f in dataclasses.fields(cls)}
            if field not in names:
                raise ValueError(f"unknown {part} field {field!r}; valid: {sorted(names)}")
            store[field] = value
        elif key in ("nodes", "gpus_per_node", "name"):
            top[key] = value
        else:
            raise ValueError(f"unknown cluster field {key!r}")
    changed = {k: v for k, v in gpu.items() if getattr(cluster.gpu, k) != v and k != "name"}
    if changed and "name" not in gpu:  # a modified GPU is no longer the preset it started from
        what = ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items()
        )
        gpu["name"] = f"{cluster.gpu.name} modified ({what})"
    return dataclasses.replace(
        cluster,
        gpu=dataclasses.replace(cluster.gpu, **gpu),
        intra_node=dataclasses.replace(cluster.intra_node, **intra),
        inter_node=dataclasses.replace(cluster.inter_node, **inter),
        **top,
    )


def load_cluster_toml(path: str | Path, nodes: int | None = None) -> Cluster:
    """A cluster from TOML: `base = "dgx-h100"`, `nodes = 8`, and `[gpu]`, `[intra_node]`,
    `[inter_node]` tables overriding any profile field."""
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no cluster file at {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p} is not valid TOML: {exc}") from exc
    base = get_cluster(str(data.pop("base", "dgx-h100")))
    overrides: dict[str, Any] = {}
    for section in ("gpu", "intra_node", "inter_node"):
        for k, v in dict(data.pop(section, {})).items():
            overrides[f"{section}.{k}"] = v
    overrides.update(data)
    if nodes is not None:
        overrides["nodes"] = nodes
    return customize(base, **overrides)
