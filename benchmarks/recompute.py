"""Activation recomputation: step time and activation memory for none / selective / full.

Activation memory is measured, not estimated, by `SavedTensorMeter` (the engine's meter): every
tensor autograd keeps for backward during the forward (deduplicated by storage, parameters
excluded), plus the inputs that checkpointed regions keep for their recomputation. Times are
the median forward+backward over --reps, modes interleaved round-robin (shared machine).

Two attention kernels are measured: the fused SDPA kernel (saves only its output and
log-sum-exp, so selective recompute has little left to save) and the unfused "math" kernel
(saves the [heads, seq, seq] softmax: the case Korthikanti et al. analysed).

    python benchmarks/recompute.py [--seq-len 512] [--out runs/recompute.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmopt.models import ModelConfig, build_model
from llmopt.models.spec import spec_for
from llmopt.parallel.recompute import RECOMPUTE_MODES, apply_activation_checkpointing
from llmopt.parallel.tensor_parallel import lm_loss
from llmopt.validate.pipeline_measure import SavedTensorMeter

BACKENDS = {"fused": None, "math": SDPBackend.MATH}


def activation_bytes(model, mode: str, tok, tgt) -> int:
    """Bytes saved for backward by one forward (the peak: nothing is freed before backward)."""
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    handles = []
    spec = spec_for(model)
    if mode != "none":  # what checkpointed regions keep alive for their recomputation
        for block in spec.blocks_of(model):
            target = block if mode == "full" else spec.block_module(block, spec.attention + ".core")

            def hook(module, args):
                for a in args:
                    if torch.is_tensor(a):
                        meter.keep(a)

            handles.append(target.register_forward_pre_hook(hook))
    with meter:
        loss = lm_loss(model, tok, tgt)
        peak = meter.peak
    loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/recompute.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        name="bench",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        max_seq_len=args.seq_len,
    )
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    tok, tgt = data[:, :-1], data[:, 1:]
    models = {}
    for mode in RECOMPUTE_MODES:
        models[mode] = apply_activation_checkpointing(build_model(cfg, seed=0), mode)

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    results = {}
    for backend_name, backend in BACKENDS.items():
        ctx = sdpa_kernel(backend) if backend is not None else _nullcontext()
        times = {m: [] for m in RECOMPUTE_MODES}
        mem = {}
        with ctx:
            for mode in RECOMPUTE_MODES:
                mem[mode] = activation_bytes(models[mode], mode, tok, tgt)
            for _ in track(range(args.reps), description=f"{backend_name} attention"):
                for mode in RECOMPUTE_MODES:
                    model = models[mode]
                    t0 = time.perf_counter()
                    lm_loss(model, tok, tgt).backward()
                    times[mode].append(time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
        base_t = statistics.median(times["none"])
        for mode in RECOMPUTE_MODES:
            t = statistics.median(times[mode])
            results[f"{backend_name}/{mode}"] = {
                "attention": backend_name,
                "recompute": mode,
                "step_s": t,
                "time_vs_none": t / base_t,
                "activation_bytes": mem[mode],
                "memory_vs_none": mem[mode] / mem["none"],
            }

    table = Table(
        title=f"recompute: {args.layers}L h{args.hidden} seq {args.seq_len} batch {args.batch}"
    )
    for col in ("attention", "recompute", "fwd+bwd (s)", "time vs none", "activations", "vs none"):
        table.add_column(col)
    for r in results.values():
        table.add_row(
            r["attention"],
            r["recompute"],
            f"{r['step_s']:.3f}",
            f"{r['time_vs_none']:.2f}x",
            f"{r['activation_bytes'] / 2**20:.1f} MiB",
            f"{r['memory_vs_none']:.2f}x",
        )
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": vars(args),
        "results": results,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out)
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for backend, marker in (("fused", "o"), ("math", "s")):
        rows = [r for r in results.values() if r["attention"] == backend]
        ax.plot(
            [r["activation_bytes"] / 2**20 for r in rows],
            [r["step_s"] for r in rows],
            marker=marker,
            label=f"{backend} attention",
        )
        for r in rows:
            ax.annotate(r["recompute"], (r["activation_bytes"] / 2**20, r["step_s"]))
    ax.set_xlabel("activation memory (MiB, measured)")
    ax.set_ylabel("forward+backward time (s)")
    ax.set_title("activation recomputation trade-off")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
