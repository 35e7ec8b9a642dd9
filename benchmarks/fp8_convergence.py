"""Does FP8 training converge like bf16? The same small Llama trained on real text per recipe.

Modes (same init, same batches, same optimizer; all under bf16 autocast with fp32 master
weights, so the only difference is the precision of the block GEMMs):
  bf16          bf16 mixed precision (the baseline)
  fp8-current   llmopt Float8Linear, per-tensor current scaling
  fp8-delayed   llmopt Float8Linear, TE-style delayed scaling (history 1024, max)
  torchao       torchao.float8.convert_to_float8_training (tensorwise dynamic scaling)
  bf16-seed<N>  bf16 again with another data order: the run-to-run noise floor

Data: the World English Bible (`corpus:web-bible`) tokenised with SmolLM2's tokenizer; the
ids the corpus actually uses are renumbered into a compact vocabulary (so the LM head does
not dwarf the blocks on a 2-core CPU); the last 5% of tokens are held out.

    python benchmarks/fp8_convergence.py --out runs/fp8_convergence.json \
        --plot docs/fp8_loss_curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from _fp8_figures import combine, plot
from _report import add_threads_argument, apply_threads, run_info, table, write_report
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmopt.data.corpus import load_text
from llmopt.models import ModelConfig, build_model
from llmopt.parallel.tensor_parallel import lm_loss as next_token_loss
from llmopt.precision.fp8 import convert_to_fp8
from llmopt.train.config import TrainConfig
from llmopt.train.trainer import lr_at

MODES = ("bf16", "fp8-current", "fp8-delayed", "torchao")


def model_config(vocab: int, args) -> ModelConfig:
    return ModelConfig(
        name="fp8-convergence",
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_layers=args.layers,
        num_heads=args.hidden // 32,
        num_kv_heads=max(1, args.hidden // 64),
        max_seq_len=args.seq,
        tie_embeddings=True,
    )


def load_tokens(max_chars: int | None) -> tuple[torch.Tensor, int]:
    """Corpus ids renumbered densely (vocab padded to a multiple of 16)."""
    from llmopt.models.loading import load_tokenizer

    text = load_text("corpus:web-bible", max_chars=max_chars)
    ids = torch.tensor(load_tokenizer("smollm2-135m").encode(text), dtype=torch.long)
    used, dense = torch.unique(ids, return_inverse=True)
    vocab = math.ceil(len(used) / 16) * 16
    return dense, vocab


def apply_mode(model, mode: str):
    if mode.startswith("fp8-"):
        return convert_to_fp8(model, mode.removeprefix("fp8-"))
    if mode == "torchao":
        from torchao.float8 import convert_to_float8_training

        # the same layers as ours: block linears only (not the LM head)
        return convert_to_float8_training(
            model, module_filter_fn=lambda _mod, fqn: fqn.startswith("layers.")
        )
    if mode.startswith("bf16"):
        return model
    raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}, bf16-seed<N>")


def schedule(args) -> TrainConfig:
    """The trainer's warmup + cosine schedule (to 0.1 x lr) with this run's settings."""
    return TrainConfig(lr=args.lr, min_lr=0.1 * args.lr, warmup_steps=args.warmup, steps=args.steps)


def batch_starts(n_tokens: int, args, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - args.seq - 1, (args.steps, args.batch), generator=gen)


def take(tokens: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    return torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return next_token_loss(model, batch[:, :-1], batch[:, 1:])


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args) -> float:
    n = args.eval_batches * args.batch
    stride = (len(val) - args.seq - 1) // n
    starts = torch.arange(n) * stride
    losses = [
        lm_loss(model, take(val, starts[i : i + args.batch], args.seq)).item()
        for i in range(0, n, args.batch)
    ]
    return sum(losses) / len(losses)


def run_mode(mode: str, train, val, cfg, args, progress) -> dict:
    data_seed = args.seed
    if mode.startswith("bf16-seed"):
        data_seed = int(mode.removeprefix("bf16-seed"))
    torch.manual_seed(args.seed)
    model = apply_mode(build_model(cfg, seed=args.seed), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    starts = batch_starts(len(train), args, data_seed)
    losses, times, evals = [], [], []
    task = progress.add_task(mode, total=args.steps)
    lr_schedule = schedule(args)
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr_schedule)
        batch = take(train, starts[step], args.seq)
        t0 = time.perf_counter()
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{mode}: loss became {losses[-1]} at step {step}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append((step + 1, evaluate(model, val, args)))
        progress.update(task, advance=1, description=f"{mode} loss {losses[-1]:.3f}")
    tail = losses[-args.tail :]
    return {
        "mode": mode,
        "train_loss": losses,
        "eval": evals,
        "final_train_loss_tail_mean": sum(tail) / len(tail),
        "final_eval_loss": evals[-1][1],
        "step_time_median_s": statistics.median(times[5:] or times),
        "step_times_s": times,
    }


def interleaved_step_times(modes, train, cfg, args, progress) -> dict[str, float]:
    """Median train-step seconds per mode, the modes taking turns step by step.

    On a shared machine, sequential runs see different background load (a whole run can be
    3x slower than the next); alternating one step of each mode spreads the load evenly.
    """
    models = {}
    for mode in modes:
        torch.manual_seed(args.seed)
        model = apply_mode(build_model(cfg, seed=args.seed), mode)
        models[mode] = (model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    starts = batch_starts(len(train), args, args.seed)
    times: dict[str, list[float]] = {m: [] for m in modes}
    task = progress.add_task("interleaved timing", total=args.timing_rounds)
    for r in range(args.timing_rounds):
        batch = take(train, starts[r % len(starts)], args.seq)
        for mode, (model, opt) in models.items():
            t0 = time.perf_counter()
            loss = lm_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times[mode].append(time.perf_counter() - t0)
        progress.update(task, advance=1)
    skip = min(2, args.timing_rounds - 1)  # first steps pay one-time allocation costs
    return {m: statistics.median(t[skip:]) for m, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES) + ",bf16-seed1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--tail", type=int, default=50, help="steps averaged for the final loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/fp8_convergence.json"))
    p.add_argument("--plot", type=Path, default=Path("runs/fp8_loss_curves.png"))
    add_threads_argument(p)
    p.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="JSONs of earlier runs (other seeds): summarise across seeds and plot",
    )
    p.add_argument("--timing-rounds", type=int, default=20, help="interleaved timing steps")
    p.add_argument(
        "--timing-only", action="store_true", help="only the interleaved step-time measurement"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    apply_threads(p, args.threads)
    modes = [m for m in args.modes.split(",") if m]
    if "bf16" not in modes:
        p.error("--modes must include bf16 (the baseline)")
    if args.hidden % 64:
        p.error(f"--hidden={args.hidden} must be a multiple of 64 (heads of 32, FP8 alignment)")
    console = Console(stderr=args.json, width=120)
    if args.combine:
        payloads = [json.loads(f.read_text()) for f in args.combine]
        stats = combine(payloads, args.plot)
        cells = [
            (
                mode,
                " ".join(f"{v:+.2f}%" for v in st["held_out_vs_bf16_pct"]),
                f"{st['mean']:+.2f}%",
                f"{st['std']:.2f}%",
            )
            for mode, st in stats.items()
        ]
        title = "held-out loss vs bf16 after the last step, across seeds"
        console.print(table(title, ("mode", "per seed", "mean", "std"), cells))
        write_report(console, args.out, {"benchmark": "fp8_convergence_seeds", "stats": stats})
        console.print(f"plot: {args.plot}")
        if args.json:
            print(json.dumps(stats, indent=1))
        return 0
    tokens, vocab = load_tokens(args.max_chars)
    split = int(len(tokens) * 0.95)
    train, val = tokens[:split], tokens[split:]
    cfg = model_config(vocab, args)
    console.print(
        f"{len(tokens):,} tokens, compact vocab {vocab}, {cfg.num_parameters() / 1e6:.2f}M params,"
        f" {args.steps} steps x {args.batch}x{args.seq} tokens, threads={torch.get_num_threads()}"
    )
    results: dict[str, dict] = {}
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    if args.timing_only:
        with Progress(*columns, console=console) as progress:
            medians = interleaved_step_times(modes, train, cfg, args, progress)
        cells = [(m, f"{sec:.3f}", f"{sec / medians['bf16']:.2f}") for m, sec in medians.items()]
        title = "train step time, modes interleaved step by step"
        console.print(table(title, ("mode", "median s", "x bf16"), cells))
        payload = {
            "benchmark": "fp8_step_time_interleaved",
            **run_info(),
            "config": cfg.to_dict(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "median_step_s": medians,
        }
        write_report(console, args.out, payload)
        return 0
    with Progress(*columns, TimeRemainingColumn(), console=console) as progress:
        for mode in modes:
            try:
                results[mode] = run_mode(mode, train, val, cfg, args, progress)
            except ImportError as exc:
                results[mode] = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
                console.print(f"[yellow]{mode} skipped: {exc}")
    ok = {m: r for m, r in results.items() if "error" not in r}
    base = ok["bf16"]
    summary = []
    for mode, res in ok.items():
        summary.append(
            {
                "mode": mode,
                "final_eval_loss": res["final_eval_loss"],
                "eval_vs_bf16_pct": 100
                * (res["final_eval_loss"] - base["final_eval_loss"])
                / base["final_eval_loss"],
                "final_train_loss": res["final_train_loss_tail_mean"],
                "train_vs_bf16_pct": 100
                * (res["final_train_loss_tail_mean"] - base["final_train_loss_tail_mean"])
                / base["final_train_loss_tail_mean"],
                "step_time_median_s": res["step_time_median_s"],
                "step_time_vs_bf16": res["step_time_median_s"] / base["step_time_median_s"],
            }
        )
    columns = ("mode", "held-out loss", "vs bf16", "train loss", "vs bf16", "step s", "x bf16")
    cells = [
        (
            s["mode"],
            f"{s['final_eval_loss']:.4f}",
            f"{s['eval_vs_bf16_pct']:+.2f}%",
            f"{s['final_train_loss']:.4f}",
            f"{s['train_vs_bf16_pct']:+.2f}%",
            f"{s['step_time_median_s']:.3f}",
            f"{s['step_time_vs_bf16']:.2f}",
        )
        for s in summary
    ]
    console.print(table(f"FP8 convergence on web-bible ({args.steps} steps)", columns, cells))
    payload = {
        "benchmark": "fp8_convergence",
        **run_info(),
        "config": cfg.to_dict(),
        "params": cfg.num_parameters(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "errors": {m: r["error"] for m, r in results.items() if "error" in r},
        "runs": ok,
    }
    write_report(console, args.out, payload)
    plot(ok, args.plot, f"{cfg.num_parameters() / 1e6:.1f}M-param Llama on web-bible")
    console.print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"summary": summary, "errors": payload["errors"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
