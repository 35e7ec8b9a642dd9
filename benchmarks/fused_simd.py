"""The fused step's cost per pass length, native build (AVX-512 VNNI or AVX2) vs the portable
scalar build, side by side in one process: what a t-token verify pass costs in 1-token steps.

    OMP_NUM_THREADS=1 python benchmarks/fused_simd.py --json runs/fused_simd.json

SmolLM2-135M as served (the packaged Q4_1 GGUF), a 200-token cached context, one thread;
each (build, t) is the minimum of `--repeats` calls, rounds interleaved between the builds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from llmopt.infer.fast import FastDecoder, build
from llmopt.infer.fast import model as fused_model
from llmopt.models.loading import load_model


def decoder_for(model, module, max_len: int) -> FastDecoder:
    fused_model.load_kernels = lambda: module
    fused_model._COMPILED.pop(model, None)
    dec = FastDecoder(model, max_len, threads=1)
    dec.prefill(list(range(100, 300)))
    return dec


def pass_s(dec: FastDecoder, t: int, repeats: int) -> float:
    n = dec.length
    toks, pos = torch.arange(1000, 1000 + t), torch.arange(n, n + t)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dec.runner.forward_tensors(
            toks, pos, pos, torch.tensor([0, t]), torch.tensor([n + t]), dec.block_table,
            torch.arange(t), dec.k_cache, dec.v_cache, dec.block_size,
        )  # fmt: skip
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1,2,3,4,5,6,8,12,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    native = build.load_kernels()
    if native is None:
        raise SystemExit(f"native kernels unavailable: {build.build_error()}")
    portable = build.load_portable_kernels()
    model = load_model("smollm2-135m", dtype="auto")
    builds = {
        native.SIMD: decoder_for(model, native, 512),
        "scalar": decoder_for(model, portable, 512),
    }
    best = {name: {t: float("inf") for t in lengths} for name in builds}
    for _ in range(args.rounds):
        for name, dec in builds.items():
            for t in lengths:
                best[name][t] = min(best[name][t], pass_s(dec, t, args.repeats))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f}; ms per pass (cost in 1-token steps)")
    print("| build | " + " | ".join(f"t={t}" for t in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, row in best.items():
        unit = row[1]
        cells = " | ".join(f"{row[t] * 1e3:.1f} ({row[t] / unit:.2f})" for t in lengths)
        print(f"| {name} | {cells} |")
    names = list(builds)
    print(
        f"1-token step: {names[0]} is {best['scalar'][1] / best[names[0]][1]:.2f}x the scalar build"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "load": load,
                    "ms": {n: {str(t): v * 1e3 for t, v in r.items()} for n, r in best.items()},
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
