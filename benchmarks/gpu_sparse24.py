"""2:4 semi-structured sparse vs dense fp16 matmul on a GPU (cuSPARSELt and CUTLASS kernels).

`y = x @ W^T` for the linears of SmolLM2-135M's MLP (gate/up 1536x576, down 576x1536) and of a
4096-wide model (14336x4096, 4096x14336), at several token counts: the dense fp16 matmul of
the 2:4-pruned weight against the same weight converted with
`torch.sparse.to_sparse_semi_structured`, with each kernel's result checked against the dense
one. Needs CUDA on an sm80+ GPU (2:4 sparse tensor cores); without one it exits with status 2
and one line saying so. The CPU path of llmopt (`SparseLinear`) gains no speed from 2:4.

    python benchmarks/gpu_sparse24.py --out runs/gpu_sparse24.json
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = {  # name -> (out_features, in_features)
    "smollm2-135m gate/up": (1536, 576),
    "smollm2-135m down": (576, 1536),
    "4096-class gate/up": (14336, 4096),
    "4096-class down": (4096, 14336),
}


def cuda_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"GPU {torch.cuda.get_device_name()} is sm{major}{minor}; 2:4 sparse needs sm80+"
    return None


def two_four_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A random fp16 weight with the 2 largest-magnitude of every 4 inputs kept."""
    from llmopt.compress.prune.masks import nm_mask

    w = torch.randn(rows, cols, generator=gen)
    return (w * nm_mask(w.abs(), 2, 4)).half().cuda()


def time_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls (CUDA events)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return sorted(samples)[len(samples) // 2]


def sparse_weight(w: torch.Tensor, backend: str):
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
    return to_sparse_semi_structured(w)


def backends() -> list[str]:
    found = ["cutlass"]
    if torch.backends.cusparselt.is_available():
        found.insert(0, "cusparselt")
    return found


def measure(tokens_list: list[int], iters: int) -> list[dict]:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for name, (out_f, in_f) in SHAPES.items():
        w = two_four_weight(out_f, in_f, gen)
        sparse = {b: sparse_weight(w, b) for b in backends()}
        for tokens in tokens_list:
            x = torch.randn(tokens, in_f, generator=gen).half().cuda()
            dense_ms = time_ms(lambda x=x, w=w: F.linear(x, w), iters)
            ref = F.linear(x, w).float()
            flops = 2 * tokens * in_f * out_f
            row = {"shape": name, "out": out_f, "in": in_f, "tokens": tokens}
            row["dense_ms"], row["dense_tflops"] = dense_ms, flops / dense_ms / 1e9
            for backend, ws in sparse.items():
                got = F.linear(x, ws).float()
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                ms = time_ms(lambda x=x, ws=ws: F.linear(x, ws), iters)
                row[f"{backend}_ms"], row[f"{backend}_speedup"] = ms, dense_ms / ms
                row[f"{backend}_rel_err"] = err
            rows_out.append(row)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,2048,8192", help="token counts (rows of x)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default="runs/gpu_sparse24.json")
    args = parser.parse_args()
    problem = cuda_problem()
    if problem:
        print(f"gpu_sparse24: {problem}; this benchmark needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from llmopt.artifacts import atomic_write_json

    rows = measure([int(t) for t in args.tokens.split(",")], args.iters)
    names = backends()
    table = Table(title=f"2:4 sparse vs dense fp16 linear on {torch.cuda.get_device_name()}")
    for col in ["shape", "tokens", "dense ms", "dense TFLOP/s"] + [f"{b} x" for b in names]:
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        cells = [r["shape"], str(r["tokens"]), f"{r['dense_ms']:.4f}", f"{r['dense_tflops']:.0f}"]
        cells += [f"{r[f'{b}_speedup']:.2f} (err {r[f'{b}_rel_err']:.0e})" for b in names]
        table.add_row(*cells)
    Console().print(table)
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backends": names,
        "rows": rows,
    }
    atomic_write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
