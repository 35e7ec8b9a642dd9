"""Training config, schedule, data order and CLI wiring (no processes)."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from llmopt.train.config import (
    TrainConfig,
    TrainConfigError,
    add_config_arguments,
    config_from_args,
)
from llmopt.train.data import TokenData
from llmopt.train.trainer import lr_at


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_file_flags_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "smollm2-135m"\nsteps = 7\n[parallel]\ntp = 2\nzero = 1\n'
        "sequence_parallel = true\n[optim]\nlr = 1e-3\n"
    )
    cfg = _parse(["--config", str(toml), "--zero", "2", "--no-sequence-parallel"])
    assert (cfg.steps, cfg.tp, cfg.zero, cfg.sequence_parallel, cfg.lr) == (7, 2, 2, False, 1e-3)
    assert cfg.micro_batch == TrainConfig().micro_batch


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(zero=5), "zero=5 is not a ZeRO stage"),
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
        TrainConfig(**changes)


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
    assert main(["train", "--zero", "4"]) == 2
    assert "zero=4 is not a ZeRO stage" in capsys.readouterr().err


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
    return TrainConfig(**base)


def test_fp8_flag_trains_with_float8_linears(tmp_path, monkeypatch):
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
    with pytest.raises(TrainConfigError, match="precision=fp8 with pp>1 is not supported"):
        _tiny(tmp_path, precision="fp8", pp=2)
    monkeypatch.setitem(sys.modules, "llmopt.precision.fp8", None)
    with pytest.raises(TrainConfigError, match="precision=fp8 needs llmopt.precision.fp8"):
        train(_tiny(tmp_path, precision="fp8"))
