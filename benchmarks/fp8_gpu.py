"""Transformer block forward+backward on an H100/H200: bf16 vs FP8 (ours, torchao, TE).

One Llama block (default: Llama-3-8B shapes, 8 x 2048 tokens) timed with CUDA events:
  bf16          the block as is (bf16 weights and activations)
  fp8-current   llmopt Float8Linear, per-tensor current scaling
  fp8-delayed   llmopt Float8Linear, TE-style delayed scaling
  torchao       torchao.float8.convert_to_float8_training (if torchao is installed)
  te            Transformer Engine te.Linear under te.fp8_autocast(DelayedScaling) (if
                transformer_engine is installed)
Only the seven block linears change between modes; RMSNorm, RoPE and SDPA attention stay
bf16. `--compile` wraps each variant in torch.compile (fuses our eager amax/scale/cast ops;
torchao's documented fast path).

Writes JSON (ms per fwd+bwd, achieved TFLOP/s, speedup vs bf16, peak memory, output error
vs bf16) to --out. On a machine without an FP8 GPU it exits with a one-line error; `--device
cpu --preset tiny` runs the same code paths on the CPU as a smoke test.

    python benchmarks/fp8_gpu.py --out runs/fp8_gpu_h100.json
    python benchmarks/fp8_gpu.py --compile --out runs/fp8_gpu_h100_compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from pathlib import Path

import torch
from _report import run_info, table, write_report
from rich.console import Console

from llmopt.models import ModelConfig
from llmopt.models.llama import Block, RotaryEmbedding
from llmopt.models.presets import get_preset
from llmopt.models.spec import get_spec
from llmopt.plan.flops import layer_flops_fwd_per_token
from llmopt.precision.fp8 import convert_to_fp8, fp8_gemm_unsupported_reason, fp8_targets

MODES = ("bf16", "fp8-current", "fp8-delayed", "torchao", "te")
TINY = ModelConfig(
    name="tiny",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=256,
)


SPEC = get_spec("llama")


class OneBlock(torch.nn.Module):
    """A single decoder block with its RoPE tables: x [B, T, H] -> [B, T, H]. The block sits
    where the spec puts a model's blocks, so its linears have the names converters look for."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg  # names the architecture's ModelSpec (what FP8 converts)
        self.add_module(SPEC.blocks, torch.nn.ModuleList([Block(cfg, 0)]))  # names as converted
        self.rotary = RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(0, x.shape[1], x.dtype)
        return SPEC.blocks_of(self)[0](x, cos, sin)


def block_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """fwd+bwd FLOPs of one block: 3 x forward, counted as `llmopt.plan.flops` counts them."""
    return 3 * layer_flops_fwd_per_token(cfg, seq) * batch * seq


def make_variant(mode: str, base: OneBlock) -> OneBlock:
    model = copy.deepcopy(base)
    if mode == "bf16":
        return model
    if mode.startswith("fp8-"):
        return convert_to_fp8(model, mode.removeprefix("fp8-"), amax_group=None)
    if mode == "torchao":
        from torchao.float8 import convert_to_float8_training

        targets = set(fp8_targets(model))
        return convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in targets)
    if mode == "te":
        import transformer_engine.pytorch as te

        targets = set(fp8_targets(model))
        for name, module in list(model.named_modules()):
            if name in targets:
                new = te.Linear(
                    module.in_features,
                    module.out_features,
                    bias=module.bias is not None,
                    params_dtype=module.weight.dtype,
                    device=module.weight.device,
                )
                with torch.no_grad():
                    new.weight.copy_(module.weight)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, new)
        return model
    raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")


def te_context(mode: str):
    if mode != "te":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))


def time_variant(model, mode, x, grad, warmup, iters, device) -> tuple[float, float, torch.Tensor]:
    """(ms per fwd+bwd, peak GiB, output of an untimed call after the timed ones).

    The output is taken last so delayed scaling is judged with a warm amax history.
    """
    cuda = device.type == "cuda"

    def step():
        with te_context(mode):
            out = model(x)
        out.backward(grad)
        return out

    for _ in range(warmup + 1):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        step()
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(end) / iters
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        ms = (time.perf_counter() - t0) * 1e3 / iters
        peak = float("nan")
    return ms, peak, step().detach()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="llama-3-8b", help="model shapes; 'tiny' for a smoke test")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile every variant")
    p.add_argument("--out", type=Path, default=Path("runs/fp8_gpu.json"))
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    console = Console(stderr=args.json, width=120)
    device = torch.device(args.device)
    reason = fp8_gemm_unsupported_reason(device)
    if reason is not None:
        console.print(f"error: {reason}")
        return 2
    cfg = TINY if args.preset == "tiny" else get_preset(args.preset)
    if args.seq > cfg.max_seq_len:
        p.error(f"--seq={args.seq} exceeds {cfg.name}'s max_seq_len={cfg.max_seq_len}")
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "bf16" not in modes:
        p.error(f"--modes: unknown {unknown} or missing bf16; valid: {', '.join(MODES)}")
    modes = ["bf16"] + [m for m in modes if m != "bf16"]  # the reference runs first
    torch.manual_seed(0)
    with torch.device(device):
        base = OneBlock(cfg)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0, 0.02)
    base = base.to(torch.bfloat16)
    x = torch.randn(args.batch, args.seq, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    flops = block_flops(cfg, args.batch, args.seq)
    rows, errors, reference = [], {}, None
    for mode in modes:
        try:
            model = make_variant(mode, base)
        except ImportError as exc:
            errors[mode] = f"not installed: {exc}"
            console.print(f"[yellow]{mode}: skipped ({exc})")
            continue
        if args.compile:
            model = torch.compile(model)
        try:
            ms, peak, out = time_variant(model, mode, x, grad, args.warmup, args.iters, device)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
            if mode == "bf16":
                raise
            errors[mode] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            console.print(f"[red]{mode}: failed ({errors[mode]})")
            continue
        branch = out.float() - x.detach().float()  # the block's residual branch, not x itself
        if mode == "bf16":
            reference = branch
        err = ((branch - reference).norm() / reference.norm()).item()
        rows.append(
            {"mode": mode, "ms": ms, "tflops": flops / ms / 1e9, "peak_gib": peak, "err": err}
        )
        del model
    base_ms = rows[0]["ms"]
    for r in rows:
        r["speedup_vs_bf16"] = base_ms / r["ms"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = f"{cfg.name} block fwd+bwd, {args.batch}x{args.seq} tokens, {name}"
    columns = ("mode", "ms", "TFLOP/s", "x bf16", "peak GiB", "branch err vs bf16")
    cells = [
        (
            r["mode"],
            f"{r['ms']:.2f}",
            f"{r['tflops']:.1f}",
            f"{r['speedup_vs_bf16']:.2f}",
            f"{r['peak_gib']:.2f}",
            f"{r['err']:.2%}",
        )
        for r in rows
    ]
    console.print(table(title + (" (compiled)" if args.compile else ""), columns, cells))
    payload = {
        "benchmark": "fp8_block_gpu",
        **run_info(),
        "device": name,
        "config": cfg.to_dict(),
        "batch": args.batch,
        "seq": args.seq,
        "compile": args.compile,
        "flops_per_iter": flops,
        "results": rows,
        "skipped": errors,
    }
    write_report(console, args.out, payload, echo=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
