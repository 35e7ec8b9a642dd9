"""Named GPU, link and cluster presets, each datasheet figure with its source.

Audited 2026-12 (issue 12) against vendor figures as quoted in the pages below (the vendors'
own PDFs are not in the reference corpus; every row names the page the figure was checked
against). Peaks are DENSE (vendors quote "with sparsity" = 2x). HBM capacity: vendors' "GB"
on HBM is close to GiB as the driver reports it (an "80 GB" H100 shows 81,559 MiB = 79.6 GiB;
the planner keeps 0.99 x the quoted figure, as it did for 80 GB boards: 79.2 GiB). Links are
per GPU, per direction: vendors quote NVLink bidirectional (H100 "900 GB/s" = 450 each way).

| GPU | HBM | dense bf16 / fp8 TFLOPS | HBM TB/s | scale-up link per dir | source |
|---|---|---|---|---|---|
| A100 SXM4 40GB | 40 GB | 312 / - | 1.555 | NVLink3 300 GB/s | NVIDIA A100 datasheet as quoted by glennklockwood.com/garden/processors/a100 |
| A100 SXM4 80GB | 80 GB | 312 / - | 2.039 | NVLink3 300 GB/s | same datasheet (80GB column) |
| H100 SXM5 | 80 GB | 989 / 1979 | 3.35 | NVLink4 450 GB/s | glennklockwood.com/garden/processors/h100 (989.4 / 3957.8 sparse fp8) |
| H100 PCIe | 80 GB | 756 / 1513 | 2.0 | PCIe Gen5 x16 64 GB/s | NVIDIA H100 PCIe product brief PB-11133-001 (manuals.plus copy: 350 W, >2,000 GB/s) |
| H800 SXM5 | 80 GB | 989 / 1979 | 3.35 | NVLink4 200 GB/s | philisun.com "NVIDIA H800 vs H100" (same die; NVLink 400 GB/s bidirectional) |
| H200 SXM | 141 GB | 989 / 1979 | 4.8 | NVLink4 450 GB/s | aiminingco.com/gpu/h200/specs, lzwjava.github.io H200 table (141 GB, 4.8 TB/s) |
| B200 (HGX, 1000 W) | 180 GB | 2250 / 4500 | 8.0 | NVLink5 900 GB/s | glennklockwood.com/garden/processors/B200 (HGX table) |
| B200 in GB200 NVL72 (1200 W) | 186 GB | 2500 / 5000 | 8.0 | NVLink5 900 GB/s, 72-GPU domain | same page (GB200 table); aiwiki.ai GB200 NVL72 (13.4 TB / 72 GPUs, 1.8 TB/s per GPU) |
| MI300X | 192 GB | 1307 / 2615 | 5.3 | Infinity Fabric 448 GB/s (7 x 64) | jaredwatkins.com AMD Instinct MI300 series (~1.3 PF fp16, ~2.6 PF fp8, 5.3 TB/s) |

The previous presets had H200 at 131 GiB and B200 at 167 GiB (141 and 180 GB read as 10^9
bytes and converted to GiB), which under-stated both by ~7 %.
"""

from __future__ import annotations

import dataclasses

from llmopt.plan.profiles import GPUProfile, LinkProfile

# Efficiencies:
# - gemm_efficiency: fraction of the dense peak that the GEMMs of a full training step sustain
#   (power/clock limits under all-SM load, per-rank shapes after TP, SMs taken by NCCL).
#   A100 0.74: cuBLAS reaches ~0.8-0.85 of 312 on large bf16 GEMMs in isolation; 0.74 puts the
#   Megatron A100 runs of Narayanan 2021 / Korthikanti 2022 (one GPU type, 30 rows, 3 mappings
#   families) at a median error of ~5 %. H100 0.55 (~545 TFLOP/s): fitted to the one fused-kernel
#   H100 row in the public anchors (Megatron-LM 1.7B, 41 % MFU) and consistent with Llama 3
#   405B's 38-43 % MFU (Dubey et al. 2024, Table 4) evaluated at its published mapping; H100
#   microbenchmarks reach 0.65-0.75 only in isolation. B200 assumed like H100 (no public data).
# - fp8_gemm_efficiency: FP8 GEMMs including their cast/amax kernels, as a fraction of the FP8
#   peak. Fitted (issue 27) on the calibration set's FP8 rows of the NeMo / Megatron-Bridge
#   performance summary: Hopper 0.47 (Llama 3 8B/70B/405B on DGX-H100, rows 401-403 and 409:
#   errors -6/-5/+5/-4 %; the previous 0.42 ran them 5-13 % slow), Blackwell 0.48 (Llama 3
#   8B/405B on DGX-B200 and 8B/70B/405B on GB200, rows 404-408: median 3 %).
# - attention_efficiency (current kernels: cuDNN as Transformer Engine >= 2 runs it, FA3) and
#   fa2_attention_efficiency (FlashAttention-2 generation: FA2, PyTorch SDPA's flash backend, 2024
#   Transformer Engine), forward + backward on the causal half. A100: FlashAttention-2 is the
#   native kernel, 50-73 % of peak forward, ~45-60 % forward+backward (Dao 2023, Fig. 4-6): 0.5.
#   H100 current 0.4 (fitted with the FP8 GEMM efficiency on the NeMo 25.x rows 401-409); H100
#   FlashAttention-2 generation 0.28, fitted (issue 27) on the calibration rows 501-509, NeMo
#   24.03's Llama 2 7B at 4K-1M tokens with CP (median 2 %): at 1M tokens attention is 98 % of the
#   FLOPs and the row's 536 TFLOP/s counting full attention is 268 TFLOP/s of causal attention,
#   0.27 of peak; FlashAttention-2's own forward ceiling on H100 is 35 % (Shah et al. 2024,
#   abstract). B200 current 0.36, read the same way from NeMo 25.04's Llama 3 8B at 1M tokens
#   (1,608 TFLOP/s counting full attention = 804 TFLOP/s = 0.36 of 2,250; rows 521-528, median
#   2 %; it was the H100's 0.4 before).
# - hbm_efficiency: STREAM-like copy kernels reach ~0.8-0.9 of HBM peak on A100/H100.
# - link efficiency: nccl-tests busbw / line rate; A100 NVLink3 ~230 of 300 GB/s, H100 NVLink4
#   ~360-370 of 450 GB/s; InfiniBand HDR/NDR busbw ~0.8 of line rate for large messages.
# Hopper, Blackwell and MI300X reuse the H100 efficiencies: no public per-kernel calibration.
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
A100_40GB = dataclasses.replace(
    A100_80GB, name="A100-SXM4-40GB", hbm_gib=39.6, hbm_bandwidth_gbs=1555.0
)
H100_SXM = GPUProfile(
    name="H100-SXM5-80GB",
    peak_bf16_tflops=989.0,
    peak_fp8_tflops=1979.0,
    hbm_gib=79.2,
    hbm_bandwidth_gbs=3350.0,
    gemm_efficiency=0.55,
    fp8_gemm_efficiency=0.47,
    attention_efficiency=0.4,
    hbm_efficiency=0.8,
    comm_overlap_efficiency=0.8,
    runtime_reserved_gib=1.5,
    allocator_margin=0.05,
    fa2_attention_efficiency=0.28,
)
H100_PCIE = dataclasses.replace(
    H100_SXM,
    name="H100-PCIe-80GB",
    peak_bf16_tflops=756.0,
    peak_fp8_tflops=1513.0,
    hbm_bandwidth_gbs=2000.0,
    tdp_w=350.0,
)
H800_SXM = dataclasses.replace(H100_SXM, name="H800-SXM5-80GB")
H200_SXM = dataclasses.replace(
    H100_SXM, name="H200-SXM-141GB", hbm_gib=139.6, hbm_bandwidth_gbs=4800.0
)
B200 = GPUProfile(
    name="B200-180GB",
    peak_bf16_tflops=2250.0,
    peak_fp8_tflops=4500.0,
    hbm_gib=178.2,
    hbm_bandwidth_gbs=8000.0,
    gemm_efficiency=0.55,
    fp8_gemm_efficiency=0.48,
    attention_efficiency=0.36,
    hbm_efficiency=0.8,
    comm_overlap_efficiency=0.8,
    runtime_reserved_gib=2.0,
    allocator_margin=0.05,
    tdp_w=1000.0,
)
B200_NVL72 = dataclasses.replace(
    B200,
    name="B200-186GB (GB200 NVL72)",
    peak_bf16_tflops=2500.0,
    peak_fp8_tflops=5000.0,
    hbm_gib=184.1,
    tdp_w=1200.0,
)
MI300X = dataclasses.replace(
    H100_SXM,
    name="MI300X-192GB",
    peak_bf16_tflops=1307.0,
    peak_fp8_tflops=2615.0,
    hbm_gib=190.1,
    hbm_bandwidth_gbs=5300.0,
    runtime_reserved_gib=2.0,
    tdp_w=750.0,
)

NVLINK3 = LinkProfile("NVLink3 (NVSwitch)", bandwidth_gbs=300.0, efficiency=0.77, latency_us=8.0)
NVLINK4 = LinkProfile("NVLink4 (NVSwitch)", bandwidth_gbs=450.0, efficiency=0.8, latency_us=8.0)
NVLINK4_H800 = dataclasses.replace(NVLINK4, name="NVLink4 (NVSwitch, H800)", bandwidth_gbs=200.0)
NVLINK5 = LinkProfile("NVLink5 (NVSwitch)", bandwidth_gbs=900.0, efficiency=0.8, latency_us=8.0)
NVLINK5_NVL72 = dataclasses.replace(NVLINK5, name="NVLink5 (NVL72 switch trays)")
# PCIe Gen5 x16: 32 GT/s x 16 lanes = 64 GB/s per direction; peer traffic through the host
# bridge reaches ~0.8 of it.
PCIE5 = LinkProfile("PCIe Gen5 x16", bandwidth_gbs=64.0, efficiency=0.8, latency_us=10.0)
# MI300X: 7 xGMI links of 64 GB/s per direction to the 7 peers of an 8-GPU board (full mesh).
XGMI = LinkProfile(
    "Infinity Fabric (xGMI mesh)", bandwidth_gbs=448.0, efficiency=0.7, latency_us=10.0
)
IB_HDR = LinkProfile(
    "InfiniBand HDR 200Gb/s per GPU", bandwidth_gbs=25.0, efficiency=0.8, latency_us=15
)
IB_NDR = LinkProfile(
    "InfiniBand NDR 400Gb/s per GPU", bandwidth_gbs=50.0, efficiency=0.8, latency_us=15
)

# name -> (GPU, scale-up link, network, GPUs per scale-up domain)
CLUSTER_PRESETS: dict[str, tuple[GPUProfile, LinkProfile, LinkProfile, int]] = {
    "dgx-a100-40gb": (A100_40GB, NVLINK3, IB_HDR, 8),
    "dgx-a100-80gb": (A100_80GB, NVLINK3, IB_HDR, 8),
    "dgx-h100": (H100_SXM, NVLINK4, IB_NDR, 8),
    "h100-pcie": (H100_PCIE, PCIE5, IB_NDR, 8),
    "dgx-h800": (H800_SXM, NVLINK4_H800, IB_NDR, 8),
    "dgx-h200": (H200_SXM, NVLINK4, IB_NDR, 8),
    "dgx-b200": (B200, NVLINK5, IB_NDR, 8),
    "gb200-nvl72": (B200_NVL72, NVLINK5_NVL72, IB_NDR, 72),
    "mi300x": (MI300X, XGMI, IB_NDR, 8),
}
CLUSTER_ALIASES = {
    "a100": "dgx-a100-80gb",
    "a100-40gb": "dgx-a100-40gb",
    "h100": "dgx-h100",
    "h800": "dgx-h800",
    "h200": "dgx-h200",
    "b200": "dgx-b200",
    "gb200": "gb200-nvl72",
    "nvl72": "gb200-nvl72",
}
