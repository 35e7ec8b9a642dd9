"""The training loop: config -> ParallelPlan -> grid -> model -> `parallelize` -> AdamW, with
logging, checkpoints and clean failure. The Engine (`llmopt.parallel.engine`) is all it talks
to: one code path for every layout, pp=1 included.

`train(config)` runs on every rank of a torchrun job (or alone). Rank 0 shows a rich progress
bar and writes the JSON-lines log; every step record carries loss (mean over all tokens of the
global batch), gradient norm, learning rate, tokens/s, MFU, memory and the counted
communication of that step per group and op.

MFU is `llmopt.plan.flops.mfu` of `model_flops_per_token` (the planner's convention: model
FLOPs with full s² attention and the output layer, no recompute), against a stated or
measured per-device peak. Logs before this change used 6N + 12·L·h·s (N counted embeddings).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmopt.artifacts import atomic_save_figure
from llmopt.models.config import ModelConfig
from llmopt.models.llama import Transformer, build_model
from llmopt.models.presets import get_preset
from llmopt.parallel.comm import CommCounter
from llmopt.parallel.engine import Engine, Objective, parallelize
from llmopt.parallel.grid import ParallelDims, RankGrid, init_distributed
from llmopt.parallel.optim import AdamW
from llmopt.plan.flops import mfu, model_flops_per_token
from llmopt.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.data import TokenData

FAULT_ENV = "LLMOPT_FAULT"  # "kind:rank:step", kind in raise|kill|kill-in-save (tests)


@dataclass
class TrainResult:
    steps: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    comm_per_step: dict = field(default_factory=dict)
    log_file: str | None = None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def model_config(cfg: TrainConfig) -> ModelConfig:
    base = get_preset(cfg.model)
    changes = {
        name: getattr(cfg, name)
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
        if getattr(cfg, name) is not None
    }
    changes["max_seq_len"] = max(base.max_seq_len, cfg.seq_len)
    return base.replace(**changes)


def build_initial_model(cfg: TrainConfig, device: torch.device) -> Transformer:
    if cfg.init_from:
        from llmopt.models.loading import load_model

        model = load_model(cfg.init_from, dtype=torch.float32, device=device)
        if cfg.seq_len > model.config.max_seq_len:
            raise TrainConfigError(
                f"seq_len={cfg.seq_len} exceeds the model context {model.config.max_seq_len}"
            )
        return model.train()
    return build_model(model_config(cfg), seed=cfg.seed, device=device).train()


def _fault(point: str, step: int, rank: int) -> None:
    """Test hook: fail on purpose as LLMOPT_FAULT says (kind:rank:step)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, f_rank, f_step = spec.split(":")
    if int(f_rank) != rank or int(f_step) != step:
        return
    if kind == "raise" and point == "step":
        raise RuntimeError(f"injected failure at step {step}")
    if (kind == "kill" and point == "step") or (kind == "kill-in-save" and point == "save"):
        os.kill(os.getpid(), signal.SIGKILL)


def _measured_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul throughput of this device (the MFU denominator when none is stated)."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    reps = 8
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS (Linux KiB)


def train(cfg: TrainConfig, objective: Objective | None = None) -> TrainResult:
    """Run training as configured on this rank; returns what rank 0 logged. `objective`
    replaces next-token CE (e.g. distillation); its metrics join each step record."""
    device, _backend = init_distributed(cfg.timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = cfg.parallel_plan(world)
    dims = ParallelDims(world, tp=plan.tp, pp=plan.pp, dp=plan.dp)
    grid = RankGrid.create(dims, timeout_s=cfg.timeout_s)
    try:
        return _train(cfg, grid, device, objective)
    except BaseException as exc:
        if world > 1 and not isinstance(exc, KeyboardInterrupt):
            print(
                f"llmopt train: {grid.describe()} failed: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
        raise


def _train(
    cfg: TrainConfig, grid: RankGrid, device: torch.device, objective: Objective | None = None
) -> TrainResult:
    dims = grid.dims
    plan = cfg.parallel_plan(dims.world_size)
    torch.manual_seed(cfg.seed)
    model = build_initial_model(cfg, device)
    mcfg = model.config
    dims.validate_model(mcfg, cfg.seq_len, cfg.sequence_parallel)
    data = TokenData.from_config(
        cfg.corpus, cfg.tokenizer, cfg.max_chars, cfg.seq_len, cfg.seed, mcfg.vocab_size
    )
    engine = parallelize(model, grid, plan, objective=objective)
    optimizer = AdamW(
        engine.master_params(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )

    out = Path(cfg.out_dir)
    ckpt_root = out / "checkpoints"
    rank0 = grid.rank == 0
    result = TrainResult()
    start = 0
    if cfg.resume:
        found = latest_checkpoint(ckpt_root)
        if found is not None:
            with grid.counter.paused():
                manifest = load_checkpoint(found, engine, optimizer, grid)
            start = manifest["step"]
            result.checkpoint = str(found)
    result.start_step = start

    peak = cfg.peak_tflops or _measured_peak_tflops(device, engine.param_dtype)
    log = None
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        result.log_file = str(out / "train_log.jsonl")
        log = open(result.log_file, "a")  # noqa: SIM115 - closed in finally
        header = {
            "event": "start",
            "config": cfg.to_dict(),
            "model": mcfg.to_dict(),
            "parameters": mcfg.num_parameters(),
            "layout": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "world": dims.world_size},
            "plan": plan.to_dict(),
            "micro_steps": plan.num_microbatches,
            "mfu_convention": "llmopt.plan.flops.model_flops_per_token (model FLOPs)",
            "start_step": start,
            "peak_tflops_per_device": peak,
            "peak_source": "stated" if cfg.peak_tflops else "measured dense matmul",
            "device": str(device),
        }
        log.write(json.dumps(header) + "\n")
        log.flush()

    progress = _progress(cfg, rank0, start)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    flops_step = model_flops_per_token(mcfg, cfg.seq_len) * tokens_per_step
    try:
        for step in range(start, cfg.steps):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            before = grid.counter.snapshot()
            t0 = time.perf_counter()
            inputs, targets = data.batch(step, cfg.global_batch, grid.dp.rank, dims.dp)
            inputs, targets = inputs.to(device), targets.to(device)
            _fault("step", step, grid.rank)
            stepped = engine.step(inputs, targets, optimizer, cfg.clip)
            loss_value, grad_norm = stepped.loss, stepped.grad_norm
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            comm = CommCounter.delta(grid.counter.snapshot(), before)
            record = {
                "event": "step",
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": grad_norm,
                "lr": lr,
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
                "mfu": mfu(flops_step, dt, dims.world_size, peak * 1e12),
                "memory_bytes": _memory_bytes(device),
                "comm": comm,
                **stepped.metrics,
            }
            result.losses.append(loss_value)
            result.steps.append(record)
            result.comm_per_step = comm
            if rank0 and log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if progress is not None:
                progress.update(step + 1, record)
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
                result.checkpoint = str(_save(cfg, ckpt_root, step + 1, engine, optimizer, grid))
    finally:
        if progress is not None:
            progress.close()
        if log is not None:
            log.write(json.dumps({"event": "end", "steps_done": len(result.losses)}) + "\n")
            log.close()
    if rank0 and result.log_file and result.losses:
        plot_losses(Path(result.log_file), out / "loss.png")
    return result


def plot_losses(log_file: Path, png: Path) -> None:
    """Loss curve of every step in a JSON-lines log (resumed segments included), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps: dict[int, float] = {}
    for line in log_file.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            steps[record["step"]] = record["loss"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = sorted(steps)
    ax.plot(xs, [steps[x] for x in xs])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(log_file.parent.name)
    fig.tight_layout()
    atomic_save_figure(fig, png)
    plt.close(fig)


def _save(
    cfg: TrainConfig, root: Path, step: int, engine: Engine, optimizer: AdamW, grid: RankGrid
) -> Path:
    def consolidated(directory: Path) -> None:
        state = engine.full_state_dict()
        if grid.rank == 0:
            from llmopt.models.loading import save_pretrained

            model = build_model(engine.model.config, seed=None)
            model.load_state_dict(state, strict=False)
            save_pretrained(model, directory)

    with grid.counter.paused():
        return save_checkpoint(
            root,
            step,
            engine,
            optimizer,
            grid,
            extra={"config": cfg.to_dict()},
            keep=cfg.keep_checkpoints,
            consolidated=consolidated,
            fault=lambda point: _fault(point, step, grid.rank),
        )


class _progress:
    """Rich progress bar plus a per-step line on rank 0 (None elsewhere)."""

    def __new__(cls, cfg: TrainConfig, rank0: bool, start: int):
        if not (rank0 and cfg.progress):
            return None
        return super().__new__(cls)

    def __init__(self, cfg: TrainConfig, rank0: bool, start: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.cfg = cfg
        self.bar = Progress(
            TextColumn("train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),  # stdout stays clean for --json
        )
        self.task = self.bar.add_task("train", total=cfg.steps, completed=start, info="")
        self.bar.start()

    def update(self, step: int, record: dict) -> None:
        info = (
            f"loss {record['loss']:.4f} | gnorm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:.0f} tok/s | MFU {100 * record['mfu']:.1f}%"
        )
        self.bar.update(self.task, completed=step, info=info)
        if step % self.cfg.log_every == 0:
            self.bar.console.log(f"step {step}: {info}")

    def close(self) -> None:
        self.bar.stop()
