"""Issue 18 part A, training side: never lose a run, never train on NaN (findings 2, 4, 5, 8).

One-process runs of a tiny model on synthetic tokens (a few seconds each); the signal test
starts `llmopt train` on two torchrun workers and stops it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmopt.cli import main as cli_main
from llmopt.parallel.engine import TrainingEngine
from llmopt.parallel.optim import AdamW
from llmopt.train.checkpoint import CheckpointError, rotate
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.launch import descendants
from llmopt.train.nonfinite import NonFiniteError
from llmopt.train.rundir import RunDirError
from llmopt.train.shapes import ShapeMismatchError
from llmopt.train.trainer import train
from tests.paths import REPO

REPO = REPO
TINY = dict(
    corpus="random",
    num_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    num_kv_heads=1,
    seq_len=16,
    global_batch=2,
    micro_batch=1,
    steps=2,
    lr=1e-3,
    min_lr=1e-3,  # constant: runs of different lengths share their steps exactly
    warmup_steps=0,
    progress=False,
    peak_tflops=1.0,
    timeout_s=20,
)


def _run(out: Path, **changes) -> object:
    return train(TrainConfig().replace(**{**TINY, "out_dir": str(out), **changes}))


def _ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


# ---- finding 2: one run per out_dir; rotation by step ----


def test_reusing_an_out_dir_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    _run(out, steps=3, save_every=1, keep_checkpoints=2)
    before = (out / "train_log.jsonl").read_text()
    with pytest.raises(RunDirError, match=r"already holds a run \(checkpoints, loss.png, "):
        _run(out)
    assert (out / "train_log.jsonl").read_text() == before  # not appended to
    # the launcher refuses before torchrun starts (one line, status 2)
    argv = ["train", "--nproc-per-node", "2", "--out-dir", str(out), "--corpus", "random"]
    assert cli_main(argv) == 2
    assert "--resume to continue a run, --overwrite to replace what a run writes" in (
        capsys.readouterr().err
    )
    # --overwrite starts afresh: only the new run's checkpoint and log remain, latest resolves
    _run(out, overwrite=True, save_every=0)
    assert _ckpts(out) == ["latest", "step_000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    events = [json.loads(line)["event"] for line in (out / "train_log.jsonl").open()]
    assert events == ["start", "step", "step", "end"]
    with pytest.raises(TrainConfigError, match="resume and overwrite contradict"):
        TrainConfig(resume=True, overwrite=True)


def test_rotation_orders_by_step_and_keeps_the_one_just_written(tmp_path):
    for step in (999_998, 999_999, 1_000_000):  # by name, step_1000000 sorts first
        (tmp_path / f"step_{step:06d}").mkdir()
    newest = tmp_path / "step_1000000"
    assert rotate(tmp_path, 2, newest) == [tmp_path / "step_999998"]
    # a stale higher step never evicts the checkpoint just written
    (tmp_path / "step_000005").mkdir()
    assert rotate(tmp_path, 1, tmp_path / "step_000005") == [tmp_path / "step_999999"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005", "step_1000000"]


# ---- finding 4: float options refused before any work ----


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr": math.nan}, "lr=nan must be a finite number"),
        ({"lr": math.inf}, "lr=inf must be a finite number"),
        ({"clip": math.nan}, "clip=nan must be a finite number"),
        ({"clip": -1.0}, r"clip=-1.0 must be >= 0 \(the gradient-norm bound; 0: no clipping\)"),
        ({"beta1": 1.0}, r"beta1=1.0 must be in \[0, 1\)"),
        ({"beta2": -0.1}, r"beta2=-0.1 must be in \[0, 1\)"),
        ({"eps": 0.0}, "eps=0.0 must be > 0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
        ({"weight_decay": math.inf}, "weight_decay=inf must be a finite number"),
        ({"peak_tflops": math.inf}, "peak_tflops=inf must be a finite number > 0"),
        ({"peak_tflops": 0.0}, "peak_tflops=0.0 must be a finite number > 0"),
        ({"timeout_s": math.nan}, "timeout_s=nan must be a finite number > 0"),
        ({"max_chars": 0}, "max_chars=0 must be a positive integer"),
        ({"skip_nonfinite_steps": -1}, "skip_nonfinite_steps=-1 must be an integer >= 0"),
    ],
)
def test_train_config_refuses_non_finite_and_out_of_range_floats(changes, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig().replace(**changes)


@pytest.mark.parametrize("flag", [["--lr", "nan"], ["--clip", "-1"], ["--peak-tflops", "inf"]])
def test_train_cli_refuses_them_in_one_line_before_launching(tmp_path, capsys, flag):
    argv = ["train", "--nproc-per-node", "2", "--out-dir", str(tmp_path / "r"), *flag]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmopt train: error: ") and "\n" not in err
    assert not (tmp_path / "r").exists()


# ---- finding 4: non-finite loss / gradient norm / state ----


def _poison_grad_norm(monkeypatch, bad_calls: set[int]) -> None:
    """TrainingEngine.grad_norm reports NaN on the given (1-based) calls: one call per step."""
    original, calls = TrainingEngine.grad_norm, [0]

    def grad_norm(self):
        calls[0] += 1
        value = original(self)
        return math.nan if calls[0] in bad_calls else value

    monkeypatch.setattr(TrainingEngine, "grad_norm", grad_norm)


def test_a_non_finite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _poison_grad_norm(monkeypatch, {3})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"step 3: loss .* gradient norm nan .* allows 0"):
        _run(out, steps=4, save_every=2)
    assert _ckpts(out) == ["latest", "step_000002"]  # nothing of step 3 was saved
    records = [json.loads(line) for line in (out / "train_log.jsonl").open()]
    assert [r.get("step") for r in records if r["event"] == "step"] == [1, 2]
    assert records[-1] == {"event": "end", "steps_done": 2}


def test_skipped_steps_apply_no_update(tmp_path, monkeypatch):
    """A run whose 4th step is skipped ends with exactly the state of a 3-step run."""
    _run(tmp_path / "three", steps=3)
    _poison_grad_norm(monkeypatch, {4})
    result = _run(tmp_path / "four", steps=4, skip_nonfinite_steps=1)
    assert math.isnan(result.steps[3]["grad_norm"]) and result.steps[3]["skipped"]
    record = json.loads((tmp_path / "four" / "train_log.jsonl").read_text().splitlines()[4])
    assert record["step"] == 4 and record["grad_norm"] is None  # JSON null, not a bare NaN
    for name in ("model.safetensors", "optimizer.safetensors"):
        three = load_file(str(tmp_path / "three/checkpoints/step_000003/full" / name))
        four = load_file(str(tmp_path / "four/checkpoints/step_000004/full" / name))
        assert three.keys() == four.keys()
        assert all(three[k].equal(four[k]) for k in three), name


def test_a_checkpoint_holding_nan_is_never_saved(tmp_path, monkeypatch):
    original, calls = AdamW.step, [0]

    def step(self):  # the 3rd update writes a NaN into a master weight
        original(self)
        calls[0] += 1
        if calls[0] == 3:
            self.param_groups[0]["params"][0].data[0] = math.nan

    monkeypatch.setattr(AdamW, "step", step)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="refusing to save a checkpoint holding NaN/inf"):
        _run(out, steps=3, save_every=2)
    assert _ckpts(out) == ["latest", "step_000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"


def test_a_bit_flipped_shard_is_refused_on_resume_naming_it(tmp_path):
    out = tmp_path / "run"
    _run(out, steps=2)
    shard = out / "checkpoints" / "step_000002" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40  # one bit of the last tensor: still a parseable file
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard} is corrupted: its SHA-256"):
        _run(out, steps=4, resume=True)


# ---- finding 5: shape flags must match the weights ----


def test_resume_and_init_from_with_disagreeing_shape_flags_name_both_values(tmp_path):
    out = tmp_path / "run"
    _run(out, steps=2)
    with pytest.raises(ShapeMismatchError, match="num_layers: checkpoint 2 vs this run 1"):
        _run(out, steps=3, resume=True, num_layers=1)
    hf = out / "checkpoints" / "step_000002" / "hf"
    with pytest.raises(
        ShapeMismatchError, match=r"--num-layers 3 disagrees with .*/hf \(num_layers=2\)"
    ):
        _run(tmp_path / "init", init_from=str(hf), num_layers=3)
    resumed = _run(out, steps=3, resume=True)  # the matching flags still resume
    assert resumed.start_step == 2 and len(resumed.losses) == 1


# ---- finding 8: a signal to `llmopt train` stops torchrun and its workers ----


@pytest.mark.dist
def test_sigterm_to_llmopt_train_leaves_no_worker_alive(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "llmopt", "train", "--nproc-per-node", "2", "--no-progress"]
    for key, value in dict(TINY, steps=100_000, out_dir=str(out)).items():
        if not isinstance(value, bool):
            args += ["--" + key.replace("_", "-"), str(value)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 150
    while not (log.is_file() and log.read_text().count('"event": "step"') >= 2):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.5)
    job = descendants(proc.pid)  # torchrun and its two workers (and their helpers)
    assert len(job) >= 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    stop = time.monotonic() + 5
    alive = job
    while alive and time.monotonic() < stop:
        alive = [(pid, t) for pid, t in job if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"still running after SIGTERM: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
