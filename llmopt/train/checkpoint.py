"""Sharded, atomic checkpoints that resume exactly.

Layout of `<out>/checkpoints/`::

    step_000040/manifest.json        step, layout (tp/pp/dp/zero), units, files, config
    step_000040/rank00000.safetensors   that rank's fp32 master shard(s), optimizer state, RNG
    step_000040/full/                full fp32 masters (and trained buffers) and AdamW moments
                                     by parameter name: resuming in a *different* TP/PP/DP/
                                     EP/CP/ZeRO layout cuts them up for the new one
    step_000040/hf/                  (optional) consolidated weights, an HF directory that
                                     `--init-from` loads into any model/layout
    step_000040/adapter/             (LoRA) the adapters in PEFT's layout
    latest                           the name of the newest complete checkpoint

`save_format` keeps only what is needed: `resume` (rank shards: resume in the same layout),
`hf` (hf/ only: not resumable), `both` (rank shards + hf/), `all` (also full/, for resuming in
another TP/DP/ZeRO layout). Sizes per format are in docs/benchmarks/finetune.md.

Atomicity: every rank writes into `step_N.partial/` (each file itself via temp + rename);
after a barrier rank 0 writes the manifest, renames the directory to `step_N` and then
replaces `latest` (temp + rename). A crash at any point leaves `latest` naming the previous
complete checkpoint; a leftover `.partial` directory is ignored and cleared by the next save.
Rotation keeps the `keep` newest by step number (never by name) and never the one just written.

Integrity: the manifest records the SHA-256 of every file; resuming verifies the files it
reads and names the one that differs (a bit flip no longer resumes to NaN). A state holding
NaN/inf is never saved (`llmopt.train.nonfinite.check_finite_state`), and a resumed run's
model must have the checkpoint's shape (`llmopt.train.shapes.check_same_model`).

Resuming restores the fp32 masters and the optimizer state bit for bit; the compute-dtype
parameters are re-derived from the masters exactly as after every step, and the data order
is a function of the step, so the loss trajectory continues identically. Resuming in another
layout restores the same values, so the trajectory continues up to floating-point reordering.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llmopt.artifacts import atomic_write, atomic_write_text, sha256_file
from llmopt.config_files import read_manifest, read_pointer
from llmopt.errors import LlmoptError
from llmopt.parallel.engine import TrainingEngine
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.optim import AdamW
from llmopt.train.nonfinite import check_finite_state
from llmopt.train.shapes import check_same_model

LATEST = "latest"
_STEP_NAME = re.compile(r"step_(\d+)")


class CheckpointError(LlmoptError, ValueError):
    """A checkpoint whose files do not match its manifest (corrupted, replaced, truncated)."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = read_pointer(root, LATEST)
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which has no manifest.json")
    return path


def save_checkpoint(
    root: str | Path,
    step: int,
    engine: TrainingEngine,
    optimizer: AdamW,
    grid: RankGrid,
    extra: dict[str, Any],
    keep: int = 2,
    consolidated: Callable[[Path], None] | None = None,
    fault: Callable[[str], None] | None = None,
    save_format: str = "all",
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    shards, full, hf = checkpoint_parts(save_format)
    root = Path(root)
    final = _step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    check_finite_state(_state_tensors(engine, optimizer), grid.world, engine.device)  # collective
    if grid.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    grid.world.barrier()

    if shards:
        _save_shard(partial, engine, optimizer, grid)
    if fault is not None:
        fault("save")
    if full:
        _save_full(partial / "full", engine, optimizer, grid)
    if hf and consolidated is not None:
        consolidated(partial / "hf")  # collective gather, rank 0 writes
    grid.world.barrier()

    if grid.rank == 0:
        manifest = {
            "step": step,
            "layout": engine.layout(),
            "world_size": grid.dims.world_size,
            "files": [f"rank{r:05d}.safetensors" for r in range(grid.dims.world_size)]
            if shards
            else [],
            "save_format": save_format,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model_config": engine.model.config.to_dict(),
            **extra,
            "sha256": {
                f.relative_to(partial).as_posix(): sha256_file(f)
                for f in sorted(partial.rglob("*"))
                if f.is_file()
            },
        }
        atomic_write_text(partial / "manifest.json", json.dumps(manifest, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(root / LATEST, final.name)
        rotate(root, keep, final)
    grid.world.barrier()
    return final


def rotate(root: Path, keep: int, written: Path) -> list[Path]:
    """Delete complete checkpoints beyond the `keep` newest by step number; the one just
    `written` is never deleted. Returns the deleted ones."""
    steps = [
        (int(m[1]), p)
        for p in root.glob("step_*")
        if p.is_dir() and (m := _STEP_NAME.fullmatch(p.name))
    ]
    ordered = [p for _, p in sorted(steps)]
    doomed = [p for p in ordered[: max(len(ordered) - keep, 0)] if p != written]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return doomed


def verify_files(path: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """Check `names` (relative to checkpoint `path`) against the manifest's SHA-256s
    (checkpoints written before checksums existed are taken as they are)."""
    recorded = manifest.get("sha256")
    if recorded is None:
        return
    for name in names:
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {file}")
        if name not in recorded:
            raise CheckpointError(f"{file} is not listed in {path / 'manifest.json'}")
        digest = sha256_file(file)
        if digest != recorded[name]:
            raise CheckpointError(
                f"{file} is corrupted: its SHA-256 {digest[:12]}... differs from "
                f"{recorded[name][:12]}... recorded in {path / 'manifest.json'}; resume from "
                "an older checkpoint (edit latest) or --init-from its hf/ directory"
            )


def _state_tensors(engine: TrainingEngine, optimizer: AdamW):
    """(name, tensor) of this rank's masters and optimizer moments: what must be finite."""
    yield from ((f"master/{k}", v) for k, v in engine.state_dict().items())
    for idx, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                yield f"optim/{idx}/{key}", value


def checkpoint_parts(save_format: str) -> tuple[bool, bool, bool]:
    """(rank shards, full/, hf/) that a save format writes."""
    parts = {
        "resume": (True, False, False),
        "hf": (False, False, True),
        "both": (True, False, True),
        "all": (True, True, True),
    }
    if save_format not in parts:
        raise CheckpointError(
            f"save_format={save_format!r} is not valid; choose one of {list(parts)}"
        )
    return parts[save_format]


def _save_shard(partial: Path, engine: TrainingEngine, optimizer: AdamW, grid: RankGrid) -> None:
    """This rank's masters, optimizer state and RNG."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, master in engine.state_dict().items():
        master = master.cpu().contiguous()
        if master.untyped_storage().data_ptr() in seen:  # tied (a frozen embedding = head):
            master = master.clone()  # safetensors refuses shared storage; loading re-ties
        seen.add(master.untyped_storage().data_ptr())
        tensors[f"master/{name}"] = master
    state = optimizer.state_dict()
    for idx, per_param in state["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"optim/{idx}/{key}"] = value.detach().cpu().contiguous().clone()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    meta = {
        "param_groups": json.dumps(state["param_groups"]),
        "rank": str(grid.rank),
        "units": json.dumps(engine.units_layout()),
    }
    name = f"rank{grid.rank:05d}.safetensors"
    atomic_write(partial / name, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def _save_full(directory: Path, engine: TrainingEngine, optimizer: AdamW, grid: RankGrid) -> None:
    """Layout-independent state: the whole model's masters, trained buffers and AdamW
    moments by name, gathered over ZeRO, TP, EP and PP (collective; rank 0 writes)."""
    masters = engine.to_first_stage(engine.full_params(), buffers=True)
    states = [optimizer.state.get(m) for m in engine.master_params()]
    moments: dict[str, torch.Tensor] = {}
    step = 0
    if all(st is not None for st in states):
        step = states[0]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            full = engine.to_first_stage(engine.gather_full([st[key] for st in states]))
            moments.update({f"{key}/{name}": t for name, t in full.items()})
    if grid.rank != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for name, tensors, meta in (
        ("model.safetensors", masters, {}),
        ("optimizer.safetensors", moments, {"step": str(step), "groups": json.dumps(groups)}),
    ):
        cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        atomic_write(
            directory / name,
            lambda tmp, cpu=cpu, meta=meta: save_file(cpu, str(tmp), metadata=meta),
        )


def _load_full(
    path: Path, engine: TrainingEngine, optimizer: AdamW, grid: RankGrid, why: str
) -> None:
    full = path / "full"
    if not (full / "model.safetensors").is_file():
        raise CheckpointError(
            f"checkpoint {path} has a different layout ({why}) and no layout-independent "
            f"state (save_format=all writes full/); start from its consolidated weights with "
            f"--init-from {path / 'hf'} (the optimizer state restarts)"
        )
    engine.load_state_dict(engine.local_from_full(load_file(str(full / "model.safetensors"))))
    from safetensors import safe_open

    with safe_open(str(full / "optimizer.safetensors"), framework="pt") as handle:
        meta = handle.metadata()
    moments = load_file(str(full / "optimizer.safetensors"))
    step = int(meta["step"])
    optimizer.state = {}
    if step > 0:
        per_key = {
            key: engine.local_from_full(
                {k.split("/", 1)[1]: v for k, v in moments.items() if k.startswith(key + "/")}
            )
            for key in ("exp_avg", "exp_avg_sq")
        }
        for name, master in zip(engine.state_dict(), engine.master_params()):
            optimizer.state[master] = {
                "step": step,
                "exp_avg": per_key["exp_avg"][name],
                "exp_avg_sq": per_key["exp_avg_sq"][name],
            }
    for group, saved in zip(optimizer.param_groups, json.loads(meta["groups"])):
        saved["betas"] = tuple(saved["betas"])
        group.update(saved)


def load_checkpoint(
    path: str | Path, engine: TrainingEngine, optimizer: AdamW, grid: RankGrid
) -> dict[str, Any]:
    """Restore this rank's state; returns the manifest.

    The same layout restores each rank's own shard bit for bit; another TP/DP/ZeRO layout
    (any of tp/pp/dp/cp/ep, ZeRO, the pipeline split) is cut from the checkpoint's full
    state."""
    path = Path(path)
    manifest = read_manifest(path)
    if not checkpoint_parts(manifest.get("save_format", "all"))[0]:
        raise CheckpointError(
            f"checkpoint {path} was saved with save_format={manifest['save_format']} and holds "
            f"no resumable state; start from its weights with --init-from {path / 'hf'}"
        )
    if "model_config" in manifest:
        check_same_model(manifest["model_config"], engine.model.config.to_dict(), str(path))
    saved, here = manifest["layout"], engine.layout()
    if saved != here:
        diff = {k: (saved.get(k), here[k]) for k in here if saved.get(k) != here[k]}
        shown = ", ".join(
            f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items() if k != "units"
        )
        if (path / "full" / "model.safetensors").is_file():
            verify_files(path, manifest, ["full/model.safetensors", "full/optimizer.safetensors"])
        _load_full(path, engine, optimizer, grid, shown or "bucket sizes")
        manifest["resharded_from"] = saved
        return manifest
    file = path / f"rank{grid.rank:05d}.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint shard missing: {file}")
    verify_files(path, manifest, [file.name])
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        meta = handle.metadata()
    if "units" in meta and json.loads(meta["units"]) != engine.units_layout():
        raise ValueError(
            f"{file} holds units {json.loads(meta['units'])}, this rank has "
            f"{engine.units_layout()}: the checkpoint is of another model split"
        )
    tensors = load_file(str(file))
    engine.load_state_dict(
        {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("master/")}
    )
    state: dict[str, Any] = {"state": {}, "param_groups": json.loads(meta["param_groups"])}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, idx, name = key.split("/", 2)
            state["state"].setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict(state)
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return manifest
