"""GEMM throughput on this CPU: fp32 vs bf16 vs FP8 (`torch._scaled_mm`, E4M3 x E4M3).

Reports what the CPU gives, honestly: torch's CPU `_scaled_mm` exists so that FP8 code runs
and can be tested anywhere; it is not a fast path (no CPU in this class has FP8 matrix
units). Two FP8 figures per shape: the GEMM alone (operands already in FP8) and the GEMM plus
the per-tensor quantisation of both operands (amax, scale, saturating cast), which is what a
Float8Linear pays per call without fused casts.

    python benchmarks/fp8.py --out runs/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from _report import add_threads_argument, apply_threads, run_info, table, write_report
from rich.console import Console

from llmopt.precision.fp8 import E4M3, compute_amax, quantize, scale_from_amax

# (M, K, N): square GEMMs, then the block GEMMs of SmolLM2-135M at 2048 tokens
SHAPES = [
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (2048, 576, 1536),  # gate/up projection
    (2048, 1536, 576),  # down projection
    (2048, 576, 576),  # q / o projection
]


def bench(fn, min_time: float, min_reps: int = 3) -> float:
    """Median seconds per call (after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_shape(m: int, k: int, n: int, min_time: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen)  # weight layout [out, in]
    a16, b16 = a.bfloat16(), b.bfloat16()

    def quantised():
        sa = scale_from_amax(compute_amax(a), E4M3)
        sb = scale_from_amax(compute_amax(b), E4M3)
        return quantize(a, sa, E4M3), sa.reciprocal(), quantize(b, sb, E4M3), sb.reciprocal()

    a8, ia, b8, ib = quantised()

    def fp8_gemm():
        return torch._scaled_mm(a8, b8.t(), scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16)

    def fp8_with_casts():
        qa, qia, qb, qib = quantised()
        return torch._scaled_mm(qa, qb.t(), scale_a=qia, scale_b=qib, out_dtype=torch.bfloat16)

    flops = 2 * m * k * n
    out = {"shape": [m, k, n]}
    for name, fn in (
        ("fp32", lambda: a @ b.t()),
        ("bf16", lambda: a16 @ b16.t()),
        ("fp8", fp8_gemm),
        ("fp8+casts", fp8_with_casts),
    ):
        seconds = bench(fn, min_time)
        out[name] = {"seconds": seconds, "gflops": flops / seconds / 1e9}
    # accuracy of the FP8 product against fp32 (relative Frobenius error)
    ref = a @ b.t()
    out["fp8_rel_err"] = ((fp8_gemm().float() - ref).norm() / ref.norm()).item()
    out["bf16_rel_err"] = (((a16 @ b16.t()).float() - ref).norm() / ref.norm()).item()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/fp8_gemm.json"))
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    apply_threads(p, args.threads)
    console = Console(stderr=args.json, width=120)
    rows = []
    for m, k, n in SHAPES:
        console.print(f"measuring {m}x{k}x{n} ...")
        rows.append(run_shape(m, k, n, args.min_time))
    columns = ("M x K x N", "fp32", "bf16", "fp8", "fp8+casts", "fp8/bf16", "fp8 err", "bf16 err")
    cells = [
        (
            "x".join(map(str, r["shape"])),
            f"{r['fp32']['gflops']:.1f}",
            f"{r['bf16']['gflops']:.1f}",
            f"{r['fp8']['gflops']:.1f}",
            f"{r['fp8+casts']['gflops']:.1f}",
            f"{r['fp8']['gflops'] / r['bf16']['gflops']:.2f}",
            f"{r['fp8_rel_err']:.3%}",
            f"{r['bf16_rel_err']:.3%}",
        )
        for r in rows
    ]
    console.print(
        table(f"GEMM throughput, GFLOP/s ({torch.get_num_threads()} threads)", columns, cells)
    )
    payload = {
        "benchmark": "fp8_gemm_cpu",
        **run_info(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "results": rows,
    }
    write_report(console, args.out, payload, echo=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
