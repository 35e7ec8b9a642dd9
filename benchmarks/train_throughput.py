"""Data-parallel training throughput: llmopt DP/ZeRO 0-3 vs PyTorch DDP, FSDP2 and DeepSpeed.

One run, one model, one batch, gloo on CPU processes (dp = --nproc), fp32, AdamW. Systems are
measured round-robin (--rounds) so that the noise of a shared machine hits all of them alike;
the figure is the median step time over all timed steps. Ratios compare like with like:
our ZeRO-0 vs DDP (replicated), ZeRO-3 vs FSDP2 (fully sharded), ZeRO-k vs DeepSpeed ZeRO-k.

    python benchmarks/train_throughput.py --nproc 2 [--deepspeed] [--out runs/train_throughput.json]

The script relaunches itself under torchrun. DeepSpeed (`pip install deepspeed`, run with
DS_ACCELERATOR=cpu) compiles ops on first use and is therefore opt-in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.engine import parallelize
from llmopt.parallel.grid import ParallelDims, RankGrid
from llmopt.parallel.optim import AdamW
from llmopt.parallel.plan import ParallelPlan
from llmopt.parallel.tensor_parallel import lm_loss
from llmopt.train.launch import launch_env, torchrun_command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed ZeRO 0-3")
    p.add_argument("--out", default="runs/train_throughput.json")
    p.add_argument("--png", default=None, help="bar chart (default: next to --out)")
    return p.parse_args(argv)


class LossModule(nn.Module):
    """The model plus its loss, so wrappers that hook `forward` (DDP, FSDP, DeepSpeed) see it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, tokens, targets)


def model_config(args) -> ModelConfig:
    return ModelConfig(
        name="bench",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_layers=args.layers,
        num_heads=max(args.hidden // 64, 1),
        num_kv_heads=max(args.hidden // 128, 1),
        max_seq_len=args.seq_len,
    )


def make_system(name: str, args):
    """(step function, description) for a system; every system starts from the same weights."""
    cfg = model_config(args)
    model = build_model(cfg, seed=0)
    if name.startswith("llmopt"):
        world = dist.get_world_size()
        plan = ParallelPlan(
            dp=world, zero_stage=int(name[-1]), micro_batch=args.micro_batch, precision="fp32"
        )
        engine = parallelize(model, RankGrid.create(ParallelDims(world)), plan)
        opt = AdamW(engine.master_params(), lr=1e-4, weight_decay=0.1)

        def step(tok, tgt):
            engine.step(tok, tgt, opt, max_norm=1.0)

        return step
    wrapped = LossModule(model)
    if name == "torch DDP":
        ddp = nn.parallel.DistributedDataParallel(wrapped)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.1)

        def step(tok, tgt):
            ddp(tok, tgt).backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        return step
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(wrapped)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, weight_decay=0.1)

        def step(tok, tgt):
            wrapped(tok, tgt).backward()
            nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        return step
    if name.startswith("DeepSpeed"):
        import deepspeed

        stage = int(name[-1])
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(
            model=wrapped, model_parameters=wrapped.parameters(), config=ds_config
        )

        def step(tok, tgt):
            loss = engine(tok, tgt)
            engine.backward(loss)
            engine.step()

        return step
    raise ValueError(f"unknown system {name!r}")


def worker(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    systems = ["llmopt ZeRO-0", "llmopt ZeRO-1", "llmopt ZeRO-2", "llmopt ZeRO-3"]
    systems += ["torch DDP", "torch FSDP2"]
    if args.deepspeed:
        systems += [f"DeepSpeed ZeRO-{k}" for k in range(4)]
    steps = {name: make_system(name, args) for name in systems}
    gen = torch.Generator().manual_seed(rank)
    cfg = model_config(args)
    data = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen)
    tok, tgt = data[:, :-1], data[:, 1:]
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name in systems:
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                steps[name](tok, tgt)
                dist.barrier()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    if rank == 0:
        report(args, cfg, world, times)
    dist.destroy_process_group()


def report(args, cfg, world, times) -> None:
    from rich.console import Console
    from rich.table import Table

    tokens = world * args.micro_batch * args.seq_len
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_step_s": med, "tokens_per_s": tokens / med, "samples": len(ts)}
    pairs = [("llmopt ZeRO-0", "torch DDP"), ("llmopt ZeRO-3", "torch FSDP2")]
    pairs += [(f"llmopt ZeRO-{k}", f"DeepSpeed ZeRO-{k}") for k in range(4)]
    ratios = {
        f"{a} / {b}": rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
        for a, b in pairs
        if a in rows and b in rows
    }
    table = Table(title=f"dp={world} gloo CPU, {cfg.num_parameters() / 1e6:.1f}M params")
    for col in ("system", "median step (s)", "tokens/s"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(name, f"{r['median_step_s']:.3f}", f"{r['tokens_per_s']:.0f}")
    console = Console()
    console.print(table)
    for k, v in ratios.items():
        console.print(f"{k}: {v:.2f}x")
    result = {
        "world": world,
        "model": cfg.to_dict(),
        "parameters": cfg.num_parameters(),
        "micro_batch_per_rank": args.micro_batch,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "systems": rows,
        "ratios": ratios,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(rows)
    ax.barh(names, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title(f"DP training throughput, dp={world}, gloo CPU")
    ax.invert_yaxis()
    fig.tight_layout()
    tmp_png = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp_png, dpi=120)
    os.replace(tmp_png, png)
    console.print(f"wrote {out} and {png}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    # torchrun would read "--nproc" after the script name as its own (ambiguous) option, so
    # the workers get the arguments without it; they take the world size from torchrun.
    given = list(argv or sys.argv[1:])
    forwarded = [
        a
        for i, a in enumerate(given)
        if not a.startswith("--nproc") and (i == 0 or given[i - 1] != "--nproc")
    ]
    cmd = torchrun_command([__file__, *forwarded], args.nproc)
    env = dict(launch_env(), OMP_NUM_THREADS="1")
    if args.deepspeed:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
