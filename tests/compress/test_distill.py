"""Distillation: the KD loss against an explicit formula, the objective inside the trainer
(1 vs 2 gloo processes, exact resume), student initialisation from the teacher, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmopt.compress.distill.objective import (
    DistillConfigError,
    DistillObjective,
    kd_loss_sum,
    kd_terms,
)
from llmopt.compress.distill.run import DistillSettings, check_out, prepare, run_rank
from llmopt.compress.distill.student import make_student, parse_layers
from llmopt.infer.drafts import EarlyExitModel
from llmopt.models import build_model
from llmopt.models.loading import load_model, save_pretrained
from llmopt.train.config import TrainConfig
from tests.dist_helpers import run_distributed


def _reference(s, t, labels, temperature, alpha):
    """T²·KL(softmax(t/T) ‖ softmax(s/T)) + CE, written out token by token in float64."""
    total = 0.0
    for i in range(s.shape[0]):
        if labels[i] == -100:
            continue
        p = torch.softmax(t[i].double() / temperature, -1)
        q = torch.softmax(s[i].double() / temperature, -1)
        kl = float((p * (p.log() - q.log())).sum())
        ce = -float(torch.log_softmax(s[i].double(), -1)[labels[i]])
        total += alpha * temperature**2 * kl + (1 - alpha) * ce
    return total


@pytest.mark.parametrize("temperature,alpha", [(1.0, 0.5), (2.0, 0.9), (4.0, 1.0), (0.5, 0.0)])
def test_kd_loss_equals_the_explicit_formula(temperature, alpha):
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(12, 50, generator=gen, dtype=torch.float64) * 3
    t = torch.randn(12, 50, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 50, (12,), generator=gen)
    labels[[2, 7]] = -100  # ignored tokens count for neither term
    got = float(kd_loss_sum(s, t, labels, temperature, alpha))
    assert got == pytest.approx(_reference(s, t, labels, temperature, alpha), abs=1e-6, rel=1e-9)
    # fp32 logits (the trainer's) agree to fp32 precision
    got32 = float(kd_loss_sum(s.float(), t.float(), labels, temperature, alpha))
    assert got32 == pytest.approx(got, rel=1e-5)
    kl, ce, n = kd_terms(s, t, labels, temperature)
    assert n == 10 and float(kl) > 0


def test_kd_of_identical_logits_is_pure_ce_and_bad_settings_are_refused():
    s = torch.randn(4, 9)
    labels = torch.tensor([1, 2, 3, 4])
    kl, ce, _ = kd_terms(s, s.clone(), labels, 2.0)
    assert abs(float(kl)) < 1e-5
    assert float(ce) == pytest.approx(
        float(torch.nn.functional.cross_entropy(s, labels, reduction="sum"))
    )
    for temperature, alpha, match in [
        (0.0, 0.5, "temperature=0.0 must be"),
        (math.nan, 0.5, "temperature=nan"),
        (1.0, 1.5, r"alpha=1.5 must be in \[0, 1\]"),
        (1.0, math.inf, "alpha=inf"),
    ]:
        with pytest.raises(DistillConfigError, match=match):
            DistillObjective(None, temperature, alpha)
    with pytest.raises(DistillConfigError, match="needs a teacher"):
        DistillObjective(None, 1.0, 0.5)
    with pytest.raises(DistillConfigError, match="teacher's vocabulary"):
        kd_terms(torch.zeros(2, 5), torch.zeros(2, 6), torch.tensor([0, 1]), 1.0)


def test_objective_reads_each_micro_batch_and_refuses_misaligned_labels(tiny_model):
    teacher = build_model(tiny_model.config, seed=3).eval()
    obj = DistillObjective(teacher, temperature=2.0, alpha=0.7)
    seq = torch.randint(0, 128, (4, 9))
    tokens, labels = seq[:, :-1], seq[:, 1:]
    loss_fn = obj.bind(tokens, labels)
    with torch.no_grad():
        total = sum(
            float(loss_fn(tiny_model(tokens[2 * k : 2 * k + 2]), labels[2 * k : 2 * k + 2]))
            for k in range(2)
        )
        expect = float(kd_loss_sum(tiny_model(tokens), teacher(tokens), labels, 2.0, 0.7))
    assert total == pytest.approx(expect, rel=1e-5)
    metrics = obj.metrics(None)
    with torch.no_grad():
        kl1, ce, n = kd_terms(tiny_model(tokens), teacher(tokens), labels, 1.0)
    assert metrics["kd_kl"] == pytest.approx(float(kl1) / n, rel=1e-5)
    assert metrics["kd_ce"] == pytest.approx(float(ce) / n, rel=1e-5)
    bad = obj.bind(tokens, labels.roll(1, dims=0))
    with pytest.raises(DistillConfigError, match="not the inputs shifted by one"):
        bad(tiny_model(tokens[:2]), labels.roll(1, dims=0)[:2])


def test_student_from_teacher_layers_and_ffn_width(tiny_model):
    cfg = tiny_model.config.replace(num_layers=4)
    teacher = build_model(cfg, seed=1).eval()
    x = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        first2 = make_student("init:teacher-layers=0-1", teacher)
        assert first2.config.num_layers == 2
        torch.testing.assert_close(first2(x), EarlyExitModel(teacher, 2)(x))
        same = make_student(f"init:teacher-layers=0-3/ffn={cfg.intermediate_size}", teacher)
        torch.testing.assert_close(same(x), teacher(x))
        narrow = make_student("init:teacher-layers=0,3/ffn=32", teacher)
    assert narrow.config.intermediate_size == 32 and narrow.config.num_layers == 2
    assert sum(p.numel() for p in narrow.parameters()) < sum(
        p.numel() for p in teacher.parameters()
    )
    assert narrow(x).shape == (2, 7, 128)
    assert parse_layers("0-2,5", 6) == [0, 1, 2, 5]
    for spec, match in [
        ("init:teacher-layers=0,4", r"layer 4 is outside \[0, 3\]"),
        ("init:teacher-layers=1,1", "repeats a layer"),
        ("init:teacher-layers=3-1", "not a layer index or range"),
        ("init:ffn=8", "needs teacher-layers"),
        ("init:teacher-layers=0/width=3", "unknown option 'width'"),
        ("init:teacher-layers=0/ffn=999", r"ffn=999 must be in \[1, 128\]"),
        ("", "empty student spec"),
    ]:
        with pytest.raises(DistillConfigError, match=match):
            make_student(spec, teacher)


# ---- the trainer with the objective: 1 vs 2 processes, resume ----

TINY = dict(
    corpus="corpus:web-bible",
    max_chars=40_000,
    seq_len=16,
    global_batch=4,
    micro_batch=1,
    steps=4,
    lr=3e-3,
    warmup_steps=1,
    progress=False,
    peak_tflops=1.0,
    timeout_s=30,
)


@pytest.fixture(scope="module")
def teacher_dir(tiny_hf_dir):
    return tiny_hf_dir(
        "tiny-teacher", seed=5, hidden_size=32, intermediate_size=64, num_layers=3,
        max_seq_len=64, tie_embeddings=True,
    )  # fmt: skip


def _rank(rank: int, world: int, config_file: str) -> dict:
    return run_rank(config_file)


def _prepared(teacher_dir, out, **changes) -> str:
    settings = DistillSettings(str(teacher_dir), "init:teacher-layers=0,2", 2.0, 0.8)
    return str(prepare(settings, TrainConfig().replace(**dict(TINY, out_dir=str(out), **changes))))


@pytest.mark.dist
def test_two_process_distill_matches_one_process_and_resume_is_exact(teacher_dir, tmp_path):
    one = run_rank(_prepared(teacher_dir, tmp_path / "one"))
    assert len(one["losses"]) == 4 and all(k is not None for k in one["kd_kl"])
    assert min(one["kd_kl"]) > 0  # a 2-of-3-layer student differs from its teacher
    log = [json.loads(line) for line in (tmp_path / "one" / "train_log.jsonl").open()]
    assert [r["kd_kl"] for r in log if r["event"] == "step"] == one["kd_kl"]
    student = load_model(one["model"])
    assert student.config.num_layers == 2

    two = run_distributed(
        _rank, 2, _prepared(teacher_dir, tmp_path / "two", zero_stage=1), timeout_s=300
    )[0]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    # KL ~1e-3 here: fp32 sums in another order move it by ~1e-8
    assert two["kd_kl"] == pytest.approx(one["kd_kl"], rel=1e-5, abs=1e-7)

    # 2 steps, then resume for the other 2: the same trajectory, bit for bit.
    first = run_rank(_prepared(teacher_dir, tmp_path / "res", steps=2))
    resumed = run_rank(_prepared(teacher_dir, tmp_path / "res", resume=True))
    assert resumed["start_step"] == 2
    assert first["losses"] + resumed["losses"] == one["losses"]
    a, b = load_model(one["model"]).state_dict(), load_model(resumed["model"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_out_may_not_be_the_teacher_and_the_teacher_needs_a_tokenizer(teacher_dir, tmp_path):
    with pytest.raises(DistillConfigError, match="is the source model"):
        check_out(teacher_dir, teacher_dir)
    with pytest.raises(DistillConfigError, match="is the source model"):
        check_out(teacher_dir / "sub", teacher_dir)
    bare = tmp_path / "bare"
    save_pretrained(load_model(teacher_dir), bare)  # no tokenizer files
    with pytest.raises(DistillConfigError, match="has no tokenizer"):
        _prepared(bare, tmp_path / "x")
    with pytest.raises(DistillConfigError, match="exceeds the teacher context"):
        _prepared(teacher_dir, tmp_path / "y", seq_len=128)


def test_cli_refuses_bad_input_in_one_line(teacher_dir, tmp_path, capsys):
    from llmopt.cli import main

    base = ["distill", "--teacher", str(teacher_dir), "--student", "init:teacher-layers=0"]
    assert main([*base, "--temperature", "0", "--out", str(tmp_path / "o")]) == 2
    assert main([*base, "--alpha", "nan", "--out", str(tmp_path / "o")]) == 2
    assert main([*base, "--out", str(teacher_dir)]) == 2
    assert main([*base, "--draft-vocab", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("llmopt distill: error: ") for line in err)
    assert "temperature=0.0" in err[0] and "alpha=nan" in err[1] and "source model" in err[2]
