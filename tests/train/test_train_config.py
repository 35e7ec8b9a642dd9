"""Training config, schedule, data order and CLI wiring (no processes)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from llmopt.data.tokens import TokenData
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.flags import add_config_arguments, config_from_args
from llmopt.train.trainer import lr_at


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_file_flags_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "smollm2-135m"\nsteps = 7\n[parallel]\ntp = 2\nzero_stage = 1\n'
        "sequence_parallel = true\n[optim]\nlr = 1e-3\n"
    )
    cfg = _parse(["--config", str(toml), "--zero-stage", "2", "--no-sequence-parallel"])
    assert (
        cfg.steps,
        cfg.parallel.tp,
        cfg.parallel.zero_stage,
        cfg.parallel.sequence_parallel,
        cfg.lr,
    ) == (
        7,
        2,
        2,
        False,
        1e-3,
    )
    assert cfg.micro_batch == TrainConfig().micro_batch


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(zero_stage=5), "zero_stage=5 is not a ZeRO stage"),
        (dict(schedule="interleaved-1f1b"), "schedule='interleaved-1f1b' is now called"),
        (dict(lr=float("nan")), "lr=nan must be a finite number"),
        (dict(clip="1.0"), "clip='1.0' must be a finite number"),
        (dict(num_microbatches=0), "num_microbatches=0 must be a positive integer"),
        (dict(cp=0), "cp=0 must be a positive integer"),
        (dict(ep=True), "ep=True must be a positive integer"),
        (dict(recompute="some"), "recompute='some' is not valid"),
        (dict(precision="int4"), "precision='int4' is not valid"),
        (dict(fp8_recipe="x"), "fp8_recipe='x' is not valid"),
        (dict(seq_len=0), "seq_len=0 must be a positive integer"),
        (dict(lr=1e-4, min_lr=1e-3), "min_lr"),
        (dict(schedule="zigzag"), "schedule='zigzag' is not valid"),
    ],
)
def test_bad_values_name_the_value(changes, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig().replace(**changes)


def test_unknown_key_and_batch_divisibility(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    with pytest.raises(TrainConfigError, match=r"unknown training config keys \['stepz'\]"):
        TrainConfig.from_file(bad)
    with pytest.raises(TrainConfigError, match="global_batch=6 is not divisible by dp=4"):
        TrainConfig(global_batch=6).micro_steps(4)
    with pytest.raises(TrainConfigError, match="global_batch/dp=3 is not divisible by micro_batch"):
        TrainConfig(global_batch=6, micro_batch=2).micro_steps(2)
    assert TrainConfig(global_batch=8, micro_batch=2).micro_steps(2) == 2


def test_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.55)  # half way through the cosine
    assert lr_at(14, cfg) == pytest.approx(0.1)


def test_data_order_is_deterministic_and_dp_shards_are_disjoint():
    tokens = torch.arange(10 * 8 + 1)
    data = TokenData(tokens, seq_len=8, seed=3)
    again = TokenData(tokens, seq_len=8, seed=3)
    seen = []
    for step in range(4):  # crosses an epoch boundary (10 sequences, 4 per step)
        parts = [data.batch(step, 4, r, 2)[0] for r in range(2)]
        assert torch.equal(torch.cat(parts), again.batch(step, 4, 0, 1)[0])
        seen += [tuple(x.tolist()) for p in parts for x in p]
    assert len(set(seen[:10])) == 10  # the first epoch visits every sequence once
    assert seen[10:] != seen[:6]  # the next epoch is reshuffled
    inputs, targets = data.batch(0, 4, 0, 1)
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    with pytest.raises(ValueError, match="too few for one sequence"):
        TokenData(torch.arange(5), seq_len=8, seed=0)


def test_train_help_and_cli_error(capsys):
    from llmopt.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    assert "--sequence-parallel" in capsys.readouterr().out
    assert main(["train", "--zero-stage", "4"]) == 2
    assert "zero_stage=4 is not a ZeRO stage" in capsys.readouterr().err
    # The old spellings are refused with the new name, not silently taken as a prefix.
    for old, new in (("--zero", "--zero-stage"), ("--microbatches", "--num-microbatches")):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", old, "1"])
        assert exit_info.value.code == 2
        assert f"{old} is now {new}" in capsys.readouterr().err


def test_old_keys_in_a_file_name_the_new_ones(tmp_path):
    for old, new in (("zero", "zero_stage"), ("microbatches", "num_microbatches")):
        path = tmp_path / "old.toml"
        path.write_text(f"[parallel]\n{old} = 1\n")
        with pytest.raises(TrainConfigError, match=f"key '{old}' is now called '{new}'"):
            TrainConfig.from_file(path)


RUN_TOML = """
[model]
model = "smollm2-135m"
[data]
seq_len = 4096
global_batch = 1024
[parallel]
tp = 2
pp = 2
dp = 2
cp = 1
ep = 1
sequence_parallel = true
zero_stage = 1
micro_batch = 1
num_microbatches = 512
schedule = "interleaved"
virtual_stages = 2
recompute = "selective"
precision = "bf16"
fp8_recipe = "current"
reduce_dtype = "fp32"
[planner]
cluster = "h100"
predicted_step_time_s = 1.5
[planner.comm]
tp = 12345
"""


def test_run_config_is_read_as_the_plan(tmp_path):
    from llmopt.parallel.plan import ParallelPlan

    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    cfg = TrainConfig.from_file(path)
    plan = cfg.parallel_plan(8)
    want = ParallelPlan.from_file(path)
    assert plan == want  # the trainer runs exactly the emitted mapping
    assert (cfg.seq_len, cfg.global_batch) == (4096, 1024)
    # Size overrides on the command line re-derive num_microbatches (8 / (dp 2 x 1) = 4).
    small = _parse(["--config", str(path), "--global-batch", "8", "--seq-len", "64"])
    assert small.parallel_plan(8) == want.replace(num_microbatches=4)
    small = _parse(["--config", str(path), "--micro-batch", "2", "--global-batch", "8"])
    assert small.parallel_plan(8).num_microbatches == 2
    # An explicit num_microbatches that contradicts the sizes is refused, naming both.
    bad = _parse(["--config", str(path), "--global-batch", "8", "--num-microbatches", "3"])
    with pytest.raises(TrainConfigError, match=r"num_microbatches=3 does not match .* = 4"):
        bad.parallel_plan(8)
    with pytest.raises(TrainConfigError, match=r"tp\*pp\*dp = 2\*2\*2 = 8 does not equal"):
        cfg.parallel_plan(4)


def test_parallel_plan_resolves_dp_and_checks_the_world():
    cfg = TrainConfig().replace(tp=2, global_batch=8, micro_batch=2)
    plan = cfg.parallel_plan(8)
    assert (plan.tp, plan.dp, plan.num_microbatches, plan.precision) == (2, 4, 1, "fp32")
    with pytest.raises(TrainConfigError, match="tp\\*pp\\*cp=2 .* does not divide the world of 3"):
        cfg.parallel_plan(3)
    with pytest.raises(TrainConfigError, match="global_batch/dp=2 is not divisible"):
        TrainConfig(global_batch=4, micro_batch=4).parallel_plan(2)


def _tiny(tmp_path, **changes) -> TrainConfig:
    base = dict(
        corpus="random",
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        seq_len=16,
        global_batch=2,
        micro_batch=1,
        steps=1,
        out_dir=str(tmp_path),
        progress=False,
        peak_tflops=1.0,
    )
    base.update(changes)
    return TrainConfig().replace(**base)


def test_fp8_flag_trains_with_float8_linears(tmp_path, monkeypatch):
    from llmopt.parallel.engine import EngineError
    from llmopt.precision import fp8
    from llmopt.train.trainer import train

    converted = []
    real_convert = fp8.convert_to_fp8

    def recording_convert(model, recipe, **kwargs):
        converted.append(real_convert(model, recipe, **kwargs))
        return converted[-1]

    monkeypatch.setattr("llmopt.precision.fp8.convert_to_fp8", recording_convert)
    result = train(_tiny(tmp_path, precision="fp8", fp8_recipe="delayed", steps=2))
    (model,) = converted
    assert len(fp8.fp8_modules(model)) == 7 * 2  # seven block linears per layer
    assert all(torch.isfinite(torch.tensor(r)) for r in result.losses)
    assert _tiny(tmp_path, precision="fp8", pp=2).parallel.pp == 2  # amaxes reduced per stage
    monkeypatch.setitem(sys.modules, "llmopt.precision.fp8", None)
    with pytest.raises(EngineError, match="precision=fp8 needs llmopt.precision.fp8"):
        train(_tiny(tmp_path, precision="fp8", overwrite=True))  # the first run's directory


def test_logged_mfu_is_the_planner_definition(tmp_path):
    from llmopt.plan.flops import model_flops_per_token
    from llmopt.train.trainer import model_config, train

    cfg = _tiny(tmp_path, steps=1, peak_tflops=2.0)
    (record,) = train(cfg).steps
    flops = model_flops_per_token(model_config(cfg), cfg.seq_len) * cfg.global_batch * cfg.seq_len
    assert record["mfu"] == pytest.approx(flops / record["step_time_s"] / 2e12, rel=1e-12)
    header = json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[0])
    assert header["plan"]["num_microbatches"] == 2  # global_batch 2 / (dp 1 x micro_batch 1)
