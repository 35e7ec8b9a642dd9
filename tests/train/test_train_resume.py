"""Checkpoints: exact resume, a crash during a save, layout changes, and failure behaviour.

The real corpus and tokenizer are used (a tiny model on web-bible, SmolLM2's vocabulary).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmopt.train.config import TrainConfig
from llmopt.train.trainer import FAULT_ENV, train
from tests.dist_helpers import run_distributed

TINY = dict(
    corpus="corpus:web-bible",
    max_chars=60_000,
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    seq_len=32,
    global_batch=4,
    micro_batch=1,
    steps=6,
    lr=3e-3,
    warmup_steps=2,
    progress=False,
    peak_tflops=1.0,
    timeout_s=20,
)


def _train_worker(rank: int, world: int, cfg: dict, fault: str | None) -> list[float]:
    if fault:
        os.environ[FAULT_ENV] = fault
    return train(TrainConfig().replace(**cfg)).losses


@pytest.mark.dist
def test_resume_is_exact_and_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    full = dict(TINY, out_dir=str(tmp_path / "a"), zero_stage=1, save_every=3)
    reference = run_distributed(_train_worker, 2, full, None, timeout_s=300)[0]
    assert len(reference) == 6 and reference[-1] < reference[0]

    # Rank 1 is killed while writing the step-4 checkpoint.
    crashed = dict(TINY, out_dir=str(tmp_path / "b"), zero_stage=1, save_every=2)
    with pytest.raises(AssertionError, match="rank 1 died"):
        run_distributed(_train_worker, 2, crashed, "kill-in-save:1:4", timeout_s=300)
    ckpts = tmp_path / "b" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000002"
    assert (ckpts / "step_000004.partial").is_dir()

    resumed = run_distributed(_train_worker, 2, dict(crashed, resume=True), None, timeout_s=300)[0]
    assert resumed == reference[2:]  # bit-identical trajectory from step 3 on
    assert (ckpts / "latest").read_text() == "step_000006"
    manifest = json.loads((ckpts / "step_000006" / "manifest.json").read_text())
    assert manifest["layout"]["dp"] == 2 and manifest["layout"]["zero"] == 1

    # Another layout (one process, ZeRO-0) resumes from the dp=2 ZeRO-1 step-3 checkpoint of
    # the reference run and continues its trajectory (fp32 sums reordered: 1e-5 relative).
    moved = tmp_path / "d" / "checkpoints"
    moved.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000003", moved / "step_000003")
    (moved / "latest").write_text("step_000003")
    resharded = train(TrainConfig().replace(**dict(TINY, out_dir=str(tmp_path / "d"), resume=True)))
    assert resharded.start_step == 3
    assert all(abs(a - b) / b < 1e-5 for a, b in zip(resharded.losses, reference[3:]))
    shutil.rmtree(moved / "step_000003" / "full")
    (moved / "latest").write_text("step_000003")
    with pytest.raises(ValueError, match=r"different layout \(dp: checkpoint 2 vs run 1"):
        train(TrainConfig().replace(**dict(TINY, out_dir=str(tmp_path / "d"), resume=True)))
    # The consolidated HF weights load into any model and layout (here one process).
    hf = ckpts / "step_000006" / "hf"
    again = train(
        TrainConfig().replace(**dict(TINY, out_dir=str(tmp_path / "c"), init_from=str(hf)))
    )
    assert again.losses[0] < reference[0] - 0.5


def _launch(tmp_path: Path, fault: str) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "llmopt", "train", "--nproc-per-node", "2"]
    for key, value in dict(TINY, out_dir=str(tmp_path), steps=4).items():
        flag = "--" + key.replace("_", "-")
        args += (
            [flag] if value is True else ["--no-progress"] if value is False else [flag, str(value)]
        )
    env = dict(os.environ, **{FAULT_ENV: fault, "OMP_NUM_THREADS": "1"})
    start = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=180)
    return proc, time.monotonic() - start


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_a_failed_rank_ends_the_job_with_a_message_naming_it(tmp_path, kind):
    proc, elapsed = _launch(tmp_path, f"{kind}:1:2")
    assert proc.returncode != 0
    assert elapsed < TINY["timeout_s"] + 60  # no hang: well within the process-group timeout
    # torchrun's failure summary names the rank that failed first and how.
    assert re.search(r"rank\s*:\s*1\b", proc.stderr), proc.stderr[-2000:]
    if kind == "kill":
        assert "SIGKILL" in proc.stderr
    else:
        assert "rank 1 (tp 0, cp 0, dp 1, pp 0) failed: RuntimeError: injected failure" in (
            proc.stderr
        )
