"""Experiment logging on rank 0: TensorBoard, Weights & Biases, MLflow (`--report-to`).

Each backend is an optional import, checked when the config is validated (a missing package is
a one-line error there). Every backend gets the same scalars per step: lr, loss, grad_norm,
tokens_per_s, mfu, the MoE routing statistics (moe_*) of a model with experts, and eval_loss
when it is measured. wandb runs in offline mode unless
WANDB_MODE says otherwise, so it needs no network (`wandb sync` uploads later).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
MOE_PREFIX = "moe_"  # MoE routing statistics (llmopt.parallel.routing): every scalar one


class _TensorBoard:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()))

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(f"train/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project="llmopt", dir=str(out), config=config, name=out.name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=out.name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


BACKENDS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow}


class Reporter:
    """Fans scalars out to the chosen backends (none: every call is a no-op)."""

    def __init__(self, targets: list[str], out: Path, config: dict[str, Any]) -> None:
        self.backends = [BACKENDS[t](out, config) for t in targets]

    def step(self, record: dict[str, Any]) -> None:
        values = {k: float(record[k]) for k in SCALARS if record.get(k) is not None}
        values.update(
            {
                k: float(v)
                for k, v in record.items()
                if k.startswith(MOE_PREFIX) and isinstance(v, int | float)
            }
        )
        self._log(values, record["step"])

    def eval(self, step: int, loss: float) -> None:
        self._log({"eval_loss": loss}, step)

    def _log(self, values: dict[str, float], step: int) -> None:
        for backend in self.backends:
            backend.log(values, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def plot_losses(log_file: Path, png: Path) -> None:
    """Loss curve of every step in a JSON-lines log (resumed segments included), atomically."""
    import json

    import matplotlib

    from llmopt.artifacts import atomic_save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps: dict[int, float] = {}
    evals: dict[int, float] = {}
    for line in log_file.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step" and record.get("loss") is not None:
            steps[record["step"]] = record["loss"]  # a skipped non-finite step logs null
        elif record.get("event") == "eval":
            evals[record["step"]] = record["eval_loss"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = sorted(steps)
    ax.plot(xs, [steps[x] for x in xs], label="training loss")
    if evals:
        es = sorted(evals)
        ax.plot(es, [evals[x] for x in es], "o-", label="held-out loss")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(log_file.parent.name)
    fig.tight_layout()
    atomic_save_figure(fig, png)
    plt.close(fig)


class Progress:
    """Rich progress bar plus a per-step line on rank 0 (`make` returns None elsewhere)."""

    @classmethod
    def make(cls, total: int, log_every: int, enabled: bool, start: int) -> Progress | None:
        return cls(total, log_every, start) if enabled else None

    def __init__(self, total: int, log_every: int, start: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.log_every = log_every
        self.bar = Bar(
            TextColumn("train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),  # stdout stays clean for --json
        )
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, step: int, record: dict) -> None:
        info = (
            f"loss {record['loss']:.4f} | gnorm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:.0f} tok/s | MFU {100 * record['mfu']:.1f}%"
        )
        self.bar.update(self.task, completed=step, info=info)
        if step % self.log_every == 0:
            self.bar.console.log(f"step {step}: {info}")

    def log(self, text: str) -> None:
        self.bar.console.log(text)

    def close(self) -> None:
        self.bar.stop()
