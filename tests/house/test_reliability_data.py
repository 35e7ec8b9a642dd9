"""Issue 18 part A, data side: never lose a user's model, never accept NaN (findings 1, 3, 4, 6).

Each test is the command (or its API) that failed on the issue's main: the source weights are
not overwritten, an interrupted replace keeps the old output, NaN/inf are refused with one
line, `--json` is valid JSON, an edited corpus file is tokenised afresh.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from llmopt.artifacts import OutputPathError, check_distinct, clean_stale, sha256_file
from llmopt.cli import main as cli_main
from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.io import save_quantized
from llmopt.infer.sampling import SamplingParams
from llmopt.jsonout import dumps
from llmopt.models import build_model
from llmopt.models.finite import NonFiniteWeightsError
from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
from llmopt.models.packed.quant.directory import MARKER, WEIGHTS, load_quantized_model
from llmopt.output_dir import output_directory
from tests.paths import REPO

REPO = REPO


def _listing(root: Path) -> dict[str, str]:
    """Every file under root with its SHA-256 (what "intact" means)."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dir):
    """A tiny model with SmolLM2's tokenizer, saved HF-style: a `--model DIR` for the CLI."""
    return tiny_hf_dir("tiny-reliability", seed=0, num_layers=1, max_seq_len=64)


# ---- finding 1: --out that is, contains or lies inside the input ----


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_quantize_refuses_an_out_overlapping_the_source_and_leaves_it_intact(hf_dir, where, capsys):
    before = _listing(hf_dir)
    out = {"same": hf_dir, "inside": hf_dir / "q", "parent": hf_dir.parent}[where]
    argv = ["quantize", "--model", str(hf_dir), "--method", "rtn", "--group-size", "32"]
    assert cli_main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmopt quantize: error: --out") and "\n" not in err
    assert {"same": " is the input", "inside": " is inside the input", "parent": " contains"}[
        where
    ] in err
    assert _listing(hf_dir) == before  # the full-precision weights are untouched


def test_check_distinct_accepts_siblings_and_unrelated_paths(tmp_path):
    (tmp_path / "src").mkdir()
    assert check_distinct(tmp_path / "src-q", tmp_path / "src") == tmp_path / "src-q"
    assert check_distinct(tmp_path / "x", "smollm2-135m") == tmp_path / "x"  # a name, no path
    with pytest.raises(OutputPathError, match="--out .* is the input"):
        check_distinct(tmp_path / "src" / ".." / "src", tmp_path / "src")


# ---- finding 3: an interrupted replace keeps the previous output ----


@pytest.fixture
def quantized(tiny_model):
    return quantize_model(tiny_model, "rtn", bits=4, group_size=32)


class _Interrupting:
    """A tokenizer whose save is interrupted (Ctrl-C) after the new weights were written."""

    def save(self, directory):
        assert (Path(directory) / WEIGHTS).is_file()
        raise KeyboardInterrupt


def test_ctrl_c_during_a_replace_keeps_the_old_model_and_no_temporary(tmp_path, quantized):
    out = save_quantized(quantized, tmp_path / "q")
    before = _listing(out)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(
            quantize_model(build_model(quantized.config, seed=7), "rtn", group_size=32),
            out,
            _Interrupting(),
        )
    assert _listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no .tmp left
    load_quantized_model(out)  # still a complete, verified model


_KILLED_SAVE = """
import os, signal, sys, torch
from pathlib import Path
from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.io import save_quantized
from llmopt.models import ModelConfig, build_model

class Killing:
    def save(self, directory):
        os.kill(os.getpid(), int(sys.argv[2]))

config = ModelConfig(name="t", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=64)
q = quantize_model(build_model(config, seed=1).eval(), "rtn", bits=4, group_size=32)
save_quantized(q, Path(sys.argv[1]), Killing())
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_replace_keeps_the_old_model_and_the_next_write_sweeps_its_temporary(
    tmp_path, quantized, signum
):
    out = save_quantized(quantized, tmp_path / "q")
    before = _listing(out)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(out), str(int(signum))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signum, proc.stderr[-2000:]
    assert _listing(out) == before  # the new weights never landed in the old directory
    leaked = [p for p in tmp_path.iterdir() if p.name != "q"]
    assert len(leaked) == 1 and leaked[0].name.startswith(".q.") and leaked[0].suffix == ".tmp"
    save_quantized(quantized, out)  # the next writer of q sweeps the dead writer's temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
    assert _listing(out) == before  # same model again, same bytes


def test_a_replace_cut_between_its_two_renames_is_restored(tmp_path):
    """Without an atomic exchange the old directory is moved aside first; a writer killed
    right then leaves it under a tagged name that `clean_stale` puts back."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid that no longer runs
    host = os.uname().nodename.split(".")[0]
    aside = tmp_path / f".out.{host}-{dead.pid}.abc123.old"
    aside.mkdir()
    (aside / MARKER).write_text("{}")
    clean_stale(tmp_path / "out")
    assert (tmp_path / "out" / MARKER).is_file() and not aside.exists()


def test_output_directory_refuses_to_replace_what_is_not_its_output(tmp_path):
    mine = tmp_path / "data"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputPathError, match="llmopt did not write .thesis.tex.*--overwrite"):
        with output_directory(mine, "quantize:llmopt"):
            pass
    assert (mine / "thesis.tex").read_text() == "years of work"


# ---- finding 4: NaN/inf refused; --json is JSON ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": math.nan}, "temperature=nan must be a finite number"),
        ({"temperature": math.inf}, "temperature=inf must be a finite number"),
        ({"top_p": math.nan}, "top_p=nan must be a finite number"),
        ({"top_p": -math.inf}, "top_p=-inf must be a finite number"),
        ({"top_k": 1.5}, "top_k=1.5 must be an integer"),
    ],
)
def test_sampling_config_refuses_non_finite_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_temperature_nan_is_one_line_before_the_model_loads(capsys):
    argv = ["generate", "--model", "/nonexistent/model", "--prompt", "x", "--temperature", "nan"]
    assert cli_main(argv) == 2  # the bad value is named, not the missing model
    err = capsys.readouterr().err.strip()
    assert err == "llmopt generate: error: --temperature nan must be a finite number"


def test_weights_with_nan_or_inf_are_refused_at_load_naming_the_tensor(tmp_path, tiny_config):
    for bad, name in ((math.nan, "layers.1.mlp.down_proj.weight"), (math.inf, "norm.weight")):
        model = build_model(tiny_config, seed=0)
        with torch.no_grad():
            model.get_parameter(name)[0] = bad
        out = save_pretrained(model, tmp_path / name)
        with pytest.raises(NonFiniteWeightsError, match=rf"tensor '{name}' holds \d+ NaN/inf"):
            load_model(out)
    load_model(save_pretrained(build_model(tiny_config, seed=0), tmp_path / "ok"))


def test_json_helper_writes_null_for_non_finite_and_never_bare_nan():
    payload = {"loss": math.nan, "peak": math.inf, "xs": [1.0, -math.inf, torch.tensor(math.nan)]}
    text = dumps(payload)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "loss": None,
        "peak": None,
        "xs": [1.0, None, None],
    }
    assert "NaN" not in dumps({"a": float("nan")}, indent=2)


# ---- finding 6: the token cache follows the corpus file's content ----


def test_token_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    from llmopt.data import tokens as data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heavens and the earth.", encoding="utf-8")
    first = data._tokenise_cached(str(corpus), "smollm2-135m", None)
    stat = corpus.stat()
    corpus.write_text("Call me Ishmael. Some years ago, never mind how long.", encoding="utf-8")
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    second = data._tokenise_cached(str(corpus), "smollm2-135m", None)
    tokenizer = load_tokenizer("smollm2-135m")
    assert second.tolist() == tokenizer.encode(corpus.read_text())
    assert first.tolist() != second.tolist()
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2
    again = data._tokenise_cached(str(corpus), "smollm2-135m", None)  # unchanged: a cache hit
    assert again.tolist() == second.tolist()
