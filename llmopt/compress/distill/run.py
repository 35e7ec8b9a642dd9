"""`distill(...)`: teacher + student spec + text -> a trained student directory.

The launcher (this process) loads the teacher once to build the starting student
(`student.make_student`), writes it to `<out>/student_init` and the run's settings to
`<out>/distill_config.json`, then runs the existing trainer on every rank (in this process
for one rank, else under torchrun: `python -m llmopt.compress.distill --config FILE`) with a
`DistillObjective`: each rank loads the teacher next to its replica, so DP and ZeRO work
unchanged (TP and PP are refused: the objective needs whole logits). Checkpoints, resume and
the JSON-lines log (`kd_kl`, `kd_ce` beside `loss`) are the trainer's. At the end rank 0
exports the last consolidated checkpoint to `<out>/model` with the teacher's tokenizer.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from llmopt.artifacts import atomic_write_text
from llmopt.compress.distill.objective import DistillConfigError, check_kd_settings
from llmopt.train.config import TrainConfig
from llmopt.train.rundir import check_run_dir

CONFIG_FILE = "distill_config.json"


@dataclass
class DistillSettings:
    teacher: str
    student: str
    temperature: float = 1.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        check_kd_settings(self.temperature, self.alpha)


def check_out(out: str | Path, *sources: str | Path | None) -> Path:
    """Refuse an --out that is a source model's directory (or inside it, or holds it)."""
    out_path = Path(out).expanduser().resolve()
    for source in sources:
        if source is None:
            continue
        src = Path(source).expanduser()
        if not src.exists():
            continue  # a packaged model name: nothing on disk to protect
        src = src.resolve()
        if out_path == src or src in out_path.parents or out_path in src.parents:
            raise DistillConfigError(
                f"--out {out_path} is the source model {src}, inside it or holds it; choose "
                "a directory outside the source"
            )
    if out_path.exists() and not out_path.is_dir():
        raise DistillConfigError(f"--out {out_path} exists and is not a directory")
    return out_path


def prepare(settings: DistillSettings, train: TrainConfig) -> Path:
    """Build and save the starting student, write the run config; returns the config file."""
    from llmopt.compress.distill.student import make_student
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained

    out = check_out(train.out_dir, settings.teacher, settings.student)
    check_run_dir(out, train.resume, train.overwrite, train.steps)  # before any write
    try:
        tokenizer = load_tokenizer(settings.teacher)
    except (ValueError, FileNotFoundError) as exc:
        raise DistillConfigError(
            f"teacher {settings.teacher!r} has no tokenizer to read the text with: {exc}"
        ) from exc
    init = out / "student_init"
    if not (train.resume and (init / "config.json").is_file()):
        teacher = load_model(settings.teacher, dtype=torch.float32)
        if train.seq_len > teacher.config.max_seq_len:
            raise DistillConfigError(
                f"seq_len={train.seq_len} exceeds the teacher context {teacher.config.max_seq_len}"
            )
        student = make_student(settings.student, teacher, seed=train.seed)
        save_pretrained(student, init, tokenizer)
    cfg = train.replace(init_from=str(init), tokenizer=settings.teacher)
    path = out / CONFIG_FILE
    atomic_write_text(path, json.dumps({"distill": asdict(settings), "train": cfg.to_dict()}))
    return path


def read_config(path: str | Path) -> tuple[DistillSettings, TrainConfig]:
    data = json.loads(Path(path).read_text())
    return DistillSettings(**data["distill"]), TrainConfig.from_dict(data["train"])


def run_rank(config_file: str | Path) -> dict[str, Any]:
    """One rank's training (what every torchrun worker runs); the summary on rank 0."""
    import torch.distributed as dist

    from llmopt.compress.distill.objective import DistillObjective
    from llmopt.models.loading import load_model
    from llmopt.parallel.grid import init_distributed
    from llmopt.train.trainer import train

    settings, cfg = read_config(config_file)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp > 1 or pp > 1:
        raise DistillConfigError(
            f"tp={tp}, pp={pp}: distillation runs data parallel (ZeRO 0-3) only; the "
            "teacher's whole logits are needed beside each replica's"
        )
    device, _ = init_distributed(cfg.timeout_s)
    teacher = None  # alpha=0 (the CE-only baseline) needs no teacher pass
    if settings.alpha > 0:
        teacher = load_model(settings.teacher, dtype=torch.float32, device=device)
    objective = DistillObjective(teacher, settings.temperature, settings.alpha)
    result = train(cfg, objective=objective)
    rank = dist.get_rank() if dist.is_initialized() else 0
    summary: dict[str, Any] = {}
    if rank == 0:
        model_dir = export_final(cfg, settings)
        kls = [s.get("kd_kl") for s in result.steps]
        summary = {
            "steps_done": len(result.losses),
            "start_step": result.start_step,
            "first_loss": result.losses[0] if result.losses else None,
            "last_loss": result.losses[-1] if result.losses else None,
            "losses": result.losses,
            "kd_kl": kls,
            "checkpoint": result.checkpoint,
            "log_file": result.log_file,
            "model": str(model_dir) if model_dir else None,
        }
    return summary


def export_final(cfg: TrainConfig, settings: DistillSettings) -> Path | None:
    """The latest consolidated checkpoint as `<out>/model` (HF directory + tokenizer)."""
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
    from llmopt.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(Path(cfg.out_dir) / "checkpoints")
    if found is None or not (found / "hf" / "config.json").is_file():
        return None
    model = load_model(found / "hf", dtype=torch.float32)
    return save_pretrained(model, Path(cfg.out_dir) / "model", load_tokenizer(settings.teacher))


def distill(settings: DistillSettings, train: TrainConfig, nproc: int = 1) -> dict[str, Any]:
    """Distil as configured on `nproc` local processes; the rank-0 summary (nproc=1) or
    {"returncode": ...} for a torchrun job (its rank 0 prints the summary)."""
    if nproc < 1:
        raise DistillConfigError(f"--nproc-per-node={nproc} must be >= 1")
    train.parallel_plan(nproc)  # the layout and batch must fit the world, now
    config_file = prepare(settings, train)
    if nproc == 1:
        return run_rank(config_file)
    from llmopt.train.launch import launch_env, torchrun_command

    target = ["-m", "llmopt.compress.distill", "--config", str(config_file), "--json"]
    code = subprocess.call(torchrun_command(target, nproc), env=launch_env())
    return {"returncode": code}
