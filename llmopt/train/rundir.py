"""The run directory (`--out-dir`): one run per directory, unless it is resumed or overwritten.

Reusing a directory without `--resume` used to mix two runs: the new run's checkpoint was the
one rotation deleted, `latest` dangled, and the log went on from the old run's. Now a directory
holding a run (anything besides what a launcher wrote for it, `LAUNCH_FILES`) is refused unless `--resume`
continues it or `--overwrite` deletes what a run writes there (checkpoints, log, loss plot)
first. Checkpoint directories a killed save left half-written (`step_N.partial`) and
temporaries of killed writers are swept at start.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.artifacts import clean_stale
from llmopt.train.config import TrainConfigError

if TYPE_CHECKING:
    from llmopt.parallel.grid import RankGrid

LAUNCH_CONFIG = "run_config.json"  # written by `llmopt train` before torchrun starts
# what launchers write before the trainer starts: `llmopt train`'s config, and `llmopt
# distill`'s config, starting student and training text (they check the directory first)
LAUNCH_FILES = frozenset({LAUNCH_CONFIG, "distill_config.json", "student_init", "train_text.txt"})
RUN_OUTPUTS = ("checkpoints", "train_log.jsonl", "loss.png", LAUNCH_CONFIG)


class RunDirError(TrainConfigError):
    """An out_dir that holds another run (neither resumed nor overwritten)."""


def previous_run(out: Path) -> list[str]:
    """Names of what `out` holds besides the launcher's config (empty: a fresh directory)."""
    if not out.is_dir():
        if out.exists():
            raise RunDirError(f"out_dir {out} exists and is not a directory")
        return []
    return sorted(p.name for p in out.iterdir() if p.name not in LAUNCH_FILES)


def check_run_dir(out: str | Path, resume: bool, overwrite: bool, steps: int | None = None) -> None:
    """Refuse an out_dir holding a run when neither `resume` nor `overwrite` is set, and a
    resume that has nothing to do (its latest checkpoint is at `steps` or beyond)."""
    out = Path(out)
    held = previous_run(out)
    if held and not (resume or overwrite):
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        what = "a run" if set(held) & set(RUN_OUTPUTS) else "files that are not a run"
        raise RunDirError(
            f"out_dir {out} already holds {what} ({shown}); pass --resume to continue a run, "
            "--overwrite to replace what a run writes there (checkpoints, log, plot; other "
            "files are kept), or choose another --out-dir"
        )
    if resume and steps is not None:
        check_resume_has_work(out, steps)


def check_resume_has_work(out: Path, steps: int) -> None:
    """A resumed run whose latest checkpoint already reached `steps` would train nothing and
    report success: refuse it, naming the step."""
    from llmopt.config_files import read_manifest
    from llmopt.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(out / "checkpoints")
    if found is None:
        return
    done = read_manifest(found)["step"]
    if done >= steps:
        raise RunDirError(
            f"nothing to do: --resume found {found} at step {done} and the run ends at step "
            f"{steps}; raise --steps above {done} to train further"
        )


def prepare_run_dir(
    out: str | Path, resume: bool, overwrite: bool, grid: RankGrid, steps: int | None = None
) -> None:
    """Collective. Every rank checks (so all refuse together, before rank 0 writes a log that
    would make a later check fail); rank 0 then deletes a previous run's outputs for
    `overwrite` and sweeps leftovers of killed saves."""
    out = Path(out)
    check_run_dir(out, resume, overwrite, steps)
    with grid.counter.paused():
        grid.world.barrier()
    if grid.rank == 0 and out.is_dir():
        _clear(out, overwrite)


def _clear(out: Path, overwrite: bool) -> None:
    if overwrite:
        for name in RUN_OUTPUTS[:-1]:  # the launch config is this run's own
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    ckpts = out / "checkpoints"
    if ckpts.is_dir():
        for partial in ckpts.glob("step_*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        clean_stale(ckpts / "latest")
