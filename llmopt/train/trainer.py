"""The training loop: config -> ParallelPlan -> grid -> model -> `parallelize` -> AdamW, with
logging, checkpoints and clean failure. The TrainingEngine (`llmopt.parallel.engine`) is all it talks
to: one code path for every layout, pp=1 included.

`train(config)` runs on every rank of a torchrun job (or alone). Rank 0 shows a rich progress
bar, writes the JSON-lines log and feeds `--report-to` backends (`llmopt.train.reporting`);
every step record carries loss (mean over the supervised tokens of the global batch), gradient
norm, learning rate, tokens/s, MFU, memory and the counted communication of that step per
group and op. With `--data` (chat / prompt-completion / text records, `llmopt.data.sft`) the
held-out loss is measured before the first step, every `eval_every` steps and after the last;
with `--lora-rank` only adapters train (`llmopt.train.lora`, `--qlora`: on an INT4 base).

MFU is `llmopt.plan.flops.mfu` of `model_flops_per_token` (the planner's convention: model
FLOPs with full s² attention and the output layer, no recompute), against a stated or
measured per-device peak. Logs before this change used 6N + 12·L·h·s (N counted embeddings).
"""

from __future__ import annotations

import dataclasses
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

from llmopt.jsonout import dumps
from llmopt.models.experts import set_routing
from llmopt.models.llama import Transformer, build_model
from llmopt.parallel.comm import CommCounter
from llmopt.parallel.engine import DTYPES, Objective, TrainingEngine, parallelize
from llmopt.parallel.grid import ParallelDims, RankGrid, init_distributed
from llmopt.parallel.optim import AdamW
from llmopt.peaks import measure_peaks
from llmopt.plan.flops import mfu, model_flops_per_token
from llmopt.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.evaluate import eval_loss
from llmopt.train.export import hf_exporter
from llmopt.train.finetune_config import report_targets
from llmopt.train.finetune_data import build_data, own_tokenizer
from llmopt.train.nonfinite import NonFiniteGuard
from llmopt.train.reporting import Progress, Reporter, plot_losses
from llmopt.train.rundir import prepare_run_dir
from llmopt.train.shapes import (
    ShapeMismatchError,
    check_dense_linears,
    check_shape_flags,
    model_config,
    with_moe_overrides,
)

FAULT_ENV = "LLMOPT_FAULT"  # "kind:rank:step", kind in raise|kill|kill-in-save (tests)


@dataclass
class TrainResult:
    steps: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    comm_per_step: dict = field(default_factory=dict)
    log_file: str | None = None
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def build_initial_model(cfg: TrainConfig, device: torch.device) -> Transformer:
    if cfg.init_from:
        from llmopt.models.loading import load_model

        model = load_model(cfg.init_from, dtype=torch.float32, device=device)
        check_shape_flags(cfg.to_dict(), model.config.to_dict(), cfg.init_from)
        set_routing(model, with_moe_overrides(model.config, cfg))
        if cfg.seq_len > model.config.max_seq_len:
            raise TrainConfigError(
                f"seq_len={cfg.seq_len} exceeds the model context {model.config.max_seq_len}"
            )
        return model.train()
    return build_model(model_config(cfg), seed=cfg.seed, device=device).train()


def lora_settings(cfg: TrainConfig):
    """The run's LoRA settings, or None without adapters."""
    if not cfg.lora_rank:
        return None
    from llmopt.train.lora import LoraSettings

    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)


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
    dims = ParallelDims.of_plan(plan)
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
    prepare_run_dir(cfg.out_dir, cfg.resume, cfg.overwrite, grid, cfg.steps)  # one run per dir
    torch.manual_seed(cfg.seed)
    model = build_initial_model(cfg, device)
    mcfg = model.config
    try:
        dims.validate_model(mcfg, cfg.seq_len, cfg.parallel.sequence_parallel)
    except ValueError as exc:  # the layout cannot split this model (`shapes.check_layout`)
        raise ShapeMismatchError(f"{exc} of the model {cfg.init_from or cfg.model}") from None
    if cfg.init_from:
        check_dense_linears(model, cfg.init_from, "--init-from", "training")
    data = build_data(cfg, mcfg.vocab_size)
    lora = lora_settings(cfg)
    if lora is not None:
        from llmopt.train.lora import apply_lora

        apply_lora(model, lora, DTYPES[plan.precision], 4 if cfg.qlora else None)
    trainable = sum(p.numel() for p in model.parameters())  # after LoRA froze the base
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

    # the MFU denominator when none is stated: this device's measured matmul peak (`llmopt.peaks`)
    peak = (
        cfg.peak_tflops
        or measure_peaks(device, engine.param_dtype, matmul_n=1024, copy_mib=16).flops_per_s / 1e12
    )
    log = None
    reporter = None
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
            "trainable_parameters": trainable,
            "data": dataclasses.asdict(data.stats) if hasattr(data, "stats") else None,
        }
        log.write(dumps(header) + "\n")
        log.flush()
        reporter = Reporter(report_targets(cfg.report_to), out, cfg.to_dict())

    progress = Progress.make(cfg.steps, cfg.log_every, rank0 and cfg.progress, start)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    flops_step = model_flops_per_token(mcfg, cfg.seq_len) * tokens_per_step
    held_out = data.eval_shard(grid.dp.rank, dims.dp) if hasattr(data, "eval_shard") else None
    evaluating = held_out is not None and data.eval_inputs.shape[0] > 0

    def evaluate(step: int) -> None:
        value = eval_loss(engine, *held_out, cfg.micro_batch)
        result.eval_losses[step] = value
        if log is not None:
            log.write(dumps({"event": "eval", "step": step, "eval_loss": value}) + "\n")
            log.flush()
        if reporter is not None:
            reporter.eval(step, value)
        if progress is not None:
            progress.log(f"step {step}: held-out loss {value:.4f}")

    guard = NonFiniteGuard(cfg.skip_nonfinite_steps)
    try:
        if evaluating and start < cfg.steps:
            evaluate(start)
        for step in range(start, cfg.steps):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            before = grid.counter.snapshot()
            t0 = time.perf_counter()
            inputs, targets = data.batch(step, cfg.global_batch, grid.dp.rank, dims.dp)
            inputs, targets = inputs.to(device), targets.to(device)
            _fault("step", step, grid.rank)
            supervised = data.supervised(step, cfg.global_batch)
            stepped = guard.step(
                engine, inputs, targets, optimizer, cfg.clip, step, num_tokens=supervised
            )
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
                "supervised_tokens": supervised,
                "comm": comm,
                **({"skipped": "non-finite loss or gradient norm"} if stepped.skipped else {}),
                **stepped.metrics,
                **stepped.routing,  # MoE: aux/z losses, imbalance, dropped, tokens per expert
            }
            result.losses.append(loss_value)
            result.steps.append(record)
            result.comm_per_step = comm
            if rank0 and log is not None:
                log.write(dumps(record) + "\n")
                log.flush()
            if progress is not None:
                progress.update(step + 1, record)
            if reporter is not None:
                reporter.step(record)
            last = step + 1 == cfg.steps
            if evaluating and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                evaluate(step + 1)
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
                result.checkpoint = str(_save(cfg, ckpt_root, step + 1, engine, optimizer, grid))
    finally:
        if progress is not None:
            progress.close()
        if reporter is not None:
            reporter.close()
        if log is not None:
            log.write(dumps({"event": "end", "steps_done": len(result.losses)}) + "\n")
            log.close()
    if rank0 and result.log_file and result.losses:
        plot_losses(Path(result.log_file), out / "loss.png")
    return result


def _save(
    cfg: TrainConfig,
    root: Path,
    step: int,
    engine: TrainingEngine,
    optimizer: AdamW,
    grid: RankGrid,
) -> Path:
    tokenizer = own_tokenizer(cfg) if cfg.tokenizer is None else cfg.tokenizer
    if cfg.corpus == "random" and cfg.data is None and cfg.tokenizer is None and not cfg.init_from:
        tokenizer = None  # synthetic tokens: no tokenizer belongs to the run
    consolidated = hf_exporter(engine, grid, tokenizer, lora_settings(cfg), cfg.init_from)
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
            save_format=cfg.save_format,
        )
