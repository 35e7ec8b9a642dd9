"""Output directories (issue 30, item 1): an `--out` holding the user's files is refused before
any work, naming it and offering `--overwrite`; with `--overwrite` only the command's own files
are replaced; an earlier output of the same kind is replaced; `merge` never deletes an
`OUT.partial` it did not create. One implementation (`llmopt.output_dir`), every command."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from llmopt.artifacts import OutputPathError
from llmopt.cli import main
from llmopt.output_dir import RECORD, check_output_dir, output_directory
from tests.finetune_fixtures import tiny_hf_model


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _user_dir(path: Path) -> dict[str, str]:
    """A directory of the user's: a note, a config.json of theirs, a subdirectory."""
    (path / "data").mkdir(parents=True)
    (path / "notes.txt").write_text("years of work")
    (path / "config.json").write_text('{"mine": true}')
    (path / "data" / "rows.csv").write_text("a,b\n1,2\n")
    return _digests(path)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


# ---- the implementation ----


def _write(stage: Path, **files: str) -> None:
    for name, text in files.items():
        (stage / name).write_text(text)


def test_new_empty_and_earlier_outputs_are_used(tmp_path):
    out = tmp_path / "out"
    with output_directory(out, "export:hf") as stage:
        _write(stage, **{"config.json": "1", "old.bin": "x"})
    record = json.loads((out / RECORD).read_text())
    assert record["kind"] == "export:hf" and record["files"] == ["config.json", "old.bin"]
    with output_directory(out, "export:hf") as stage:  # an earlier output: replaced whole
        _write(stage, **{"config.json": "2"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", RECORD]
    assert (out / "config.json").read_text() == "2"
    empty = tmp_path / "empty"
    empty.mkdir()
    with output_directory(empty, "prune") as stage:
        _write(stage, weights="w")
    assert (empty / "weights").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]  # no staging left


def test_a_user_directory_is_refused_naming_it_and_offering_overwrite(tmp_path):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    with pytest.raises(OutputPathError) as caught:
        check_output_dir(mine, "export:hf")
    message = str(caught.value)
    assert str(mine) in message and "--overwrite" in message and "notes.txt" in message
    assert "llmopt export --format hf" in message
    with pytest.raises(OutputPathError):
        with output_directory(mine, "export:hf") as stage:
            _write(stage, **{"config.json": "ours"})
    assert _digests(mine) == before


def test_overwrite_replaces_only_the_commands_files(tmp_path):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    with output_directory(mine, "export:hf", overwrite=True) as stage:
        _write(stage, **{"config.json": "ours", "model.safetensors": "w", "stale.bin": "s"})
    after = _digests(mine)
    kept = {k: v for k, v in before.items() if k != "config.json"}
    assert {k: after[k] for k in kept} == kept  # every other file of the user's as it was
    assert (mine / "config.json").read_text() == "ours"  # the command's own file replaced
    # a later export (same kind, no --overwrite) replaces its own files, drops its own stale one
    with output_directory(mine, "export:hf") as stage:
        _write(stage, **{"config.json": "new", "model.safetensors": "w2"})
    assert not (mine / "stale.bin").exists() and (mine / "notes.txt").read_text() == "years of work"
    assert (mine / "data" / "rows.csv").is_file()
    assert json.loads((mine / RECORD).read_text())["files"] == ["config.json", "model.safetensors"]


def test_another_kind_of_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "out"
    with output_directory(out, "export:hf") as stage:
        _write(stage, **{"config.json": "hf"})
    with pytest.raises(OutputPathError, match="earlier `llmopt export --format hf` output"):
        check_output_dir(out, "export:onnx")
    with output_directory(out, "export:onnx", overwrite=True) as stage:
        _write(stage, **{"model.onnx": "graph"})
    # the earlier llmopt output's files are llmopt's, not the user's: replaced
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "model.onnx"]


def test_a_failed_run_leaves_the_directory_as_it_was(tmp_path):
    out = tmp_path / "out"
    with output_directory(out, "merge") as stage:
        _write(stage, **{"config.json": "v1"})
    before = _digests(out)
    with pytest.raises(KeyboardInterrupt):
        with output_directory(out, "merge") as stage:
            _write(stage, **{"config.json": "v2"})
            raise KeyboardInterrupt
    assert _digests(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_older_llmopt_output_is_recognised_by_its_marker(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "llmopt_quant.json").write_text("{}")
    (out / "llmopt_quant.safetensors").write_text("w")
    (out / "notes.txt").write_text("mine")
    claim = check_output_dir(out, "quantize:llmopt")
    assert claim.same_kind and "notes.txt" in claim.foreign  # kept, not ours to delete
    with pytest.raises(OutputPathError):
        check_output_dir(out, "prune")


def test_a_record_never_claims_files_outside_or_other_formats(tmp_path):
    mine = tmp_path / "mine"
    _user_dir(mine)
    (mine / RECORD).write_text(json.dumps({"format": "llmopt-output", "files": ["../x"]}))
    with pytest.raises(OutputPathError, match="llmopt did not write"):
        check_output_dir(mine, "export:hf")  # a malformed record makes nothing ours
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(OutputPathError, match="is a file, not a directory"):
        check_output_dir(file, "prune")


# ---- every command that writes a directory ----


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_hf_model(tmp_path_factory.mktemp("base") / "base")


@pytest.mark.parametrize(
    "argv, kind",
    [
        (["export", "--format", "hf"], "export --format hf"),
        (["export", "--format", "onnx"], "export --format onnx"),
        (["quantize", "--format", "llmopt", "--method", "rtn"], "quantize --format llmopt"),
        (["quantize", "--format", "gptq", "--method", "rtn"], "quantize --format gptq"),
        (
            ["quantize", "--format", "compressed-tensors", "--method", "rtn"],
            "quantize --format compressed-tensors",
        ),
        (["quantize", "--format", "autoawq", "--method", "rtn"], "quantize --format autoawq"),
        (["prune", "--method", "magnitude"], "prune"),
    ],
)
def test_each_command_refuses_a_user_directory_before_any_work(argv, kind, tmp_path, capsys):
    """Refused before the model loads (the model named does not even exist)."""
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    code, err = _run(
        [*argv, "--model", str(tmp_path / "no-such-model"), "--out", str(mine)], capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(mine) in err and "--overwrite" in err and f"`llmopt {kind}`" in err
    assert _digests(mine) == before


def test_export_gguf_refuses_a_file_that_is_not_a_gguf(tmp_path, capsys):
    mine = tmp_path / "model.gguf"
    mine.write_text("my notes, not a model")
    code, err = _run(["export", "--model", "x", "--format", "gguf", "--out", str(mine)], capsys)
    assert code == 2 and "is not a GGUF file" in err and "--overwrite" in err
    assert mine.read_text() == "my notes, not a model"


def test_export_hf_with_overwrite_keeps_the_users_files(base, tmp_path, capsys):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    code, _ = _run(["export", "--model", str(base), "--format", "hf", "--out", str(mine), "--overwrite"], capsys)  # fmt: skip
    assert code == 0
    after = _digests(mine)
    assert all(after[k] == v for k, v in before.items() if k != "config.json")
    assert json.loads((mine / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert {"model.safetensors", "tokenizer.json", RECORD} <= {p.name for p in mine.iterdir()}


def test_quantize_gptq_with_overwrite_keeps_the_users_files(base, tmp_path, capsys):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    argv = ["quantize", "--model", str(base), "--method", "rtn", "--group-size", "32"]
    code, _ = _run([*argv, "--format", "gptq", "--out", str(mine), "--overwrite", "--json"], capsys)
    assert code == 0
    after = _digests(mine)
    assert all(after[k] == v for k, v in before.items() if k != "config.json")
    assert (mine / "quantize_config.json").is_file()
    code, _ = _run([*argv, "--format", "gptq", "--out", str(mine), "--json"], capsys)
    assert code == 0  # its own earlier output: no --overwrite needed, the notes still there
    assert (mine / "notes.txt").read_text() == "years of work"


def test_prune_with_overwrite_keeps_the_users_files(base, tmp_path, capsys):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    argv = ["prune", "--model", str(base), "--method", "magnitude", "--sparsity", "2:4"]
    code, _ = _run([*argv, "--out", str(mine), "--overwrite", "--json"], capsys)
    assert code == 0
    after = _digests(mine)
    assert all(after[k] == v for k, v in before.items() if k != "config.json")
    assert (mine / "llmopt_prune.json").is_file()


def test_quantize_gguf_type_with_another_format_is_refused(tmp_path, capsys):
    code, err = _run(
        ["quantize", "--format", "gptq", "--gguf-type", "q8_0", "--out", str(tmp_path / "q")],
        capsys,
    )
    assert code == 2 and "--gguf-type q8_0 applies to --format gguf only" in err


# ---- merge ----


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    from llmopt.models.loading import load_model
    from llmopt.train.lora import LoraSettings, apply_lora, lora_modules, save_adapter

    model = load_model(base, dtype=torch.float32)
    settings = LoraSettings(rank=2, alpha=4.0)
    apply_lora(model, settings)
    torch.manual_seed(0)
    for lora in lora_modules(model).values():
        torch.nn.init.normal_(lora.lora_B.weight, std=0.05)
    return save_adapter(model, tmp_path_factory.mktemp("adapter") / "adapter", settings, str(base))


def test_merge_never_deletes_a_partial_directory_it_did_not_create(base, adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    partial = tmp_path / "merged.partial"
    partial.mkdir()
    (partial / "draft.txt").write_text("the user's")
    code, err = _run(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)], capsys)  # fmt: skip
    assert code == 0, err
    assert (partial / "draft.txt").read_text() == "the user's"
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.partial"]


def test_merge_refuses_a_base_with_other_weights_of_the_same_shape(base, adapter, tmp_path, capsys):
    from llmopt.models import build_model
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained

    other = tmp_path / "other-base"  # the same architecture and shape, other weights
    save_pretrained(build_model(load_model(base).config, seed=7), other, load_tokenizer(base))
    out = tmp_path / "merged"
    code, err = _run(["merge", "--base", str(other), "--adapter", str(adapter), "--out", str(out)], capsys)  # fmt: skip
    assert code == 2 and "trained on another base" in err and str(other) in err
    assert not out.exists()


def test_merge_refuses_a_quantized_base_in_one_line(base, adapter, tmp_path, capsys):
    q = tmp_path / "q"
    code, _ = _run(["quantize", "--model", str(base), "--method", "rtn", "--group-size", "32", "--out", str(q), "--json"], capsys)  # fmt: skip
    assert code == 0
    code, err = _run(["merge", "--base", str(q), "--adapter", str(adapter), "--out", str(tmp_path / "m")], capsys)  # fmt: skip
    assert code == 2 and "QuantLinear" in err and "full-precision" in err, err


# ---- distill and compress --recipe ----


def test_distill_refuses_a_user_directory_before_loading_the_teacher(tmp_path, capsys):
    mine = tmp_path / "mine"
    before = _user_dir(mine)
    argv = ["distill", "--teacher", "smollm2-135m", "--student", "init:teacher-layers=0"]
    code, err = _run([*argv, "--out", str(mine)], capsys)
    assert code == 2 and "files that are not a run" in err and "--overwrite" in err, err
    assert _digests(mine) == before


def _recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(f'model = "smollm2-135m"\nout = "{tmp_path / "out"}"\n{body}')
    return path


@pytest.mark.parametrize(
    "body, names",
    [
        ('stage = {kind = "prune"}\n', ("stage", "[[stage]]")),
        ('eval = "corpus:web-bible"\n[[stage]]\nkind = "fuse"\n', ("eval", "a table")),
        ('[eval]\nmax_tokens = "many"\n[[stage]]\nkind = "fuse"\n', ("max_tokens", "'many'")),
        ('[[stage]]\nkind = "quantize"\nbits = "4"\n', ("bits", "'4'")),
        ('[[stage]]\nkind = "distill"\nsteps = [40]\n', ("steps", "integer")),
    ],
)
def test_recipe_types_are_one_line_errors(body, names, tmp_path, capsys):
    code, err = _run(["compress", "--recipe", str(_recipe(tmp_path, body))], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(n in err for n in names), err


def test_recipe_refuses_a_user_directory(tmp_path, capsys):
    before = _user_dir(tmp_path / "out")
    code, err = _run(["compress", "--recipe", str(_recipe(tmp_path, '[[stage]]\nkind = "fuse"\n'))], capsys)  # fmt: skip
    assert code == 2 and "--overwrite" in err and "notes.txt" in err
    assert _digests(tmp_path / "out") == before
