"""`llmopt compress --recipe`: every stage of prune -> distil -> quantize is written and
measured against the original; sparsity survives the distil stage; bad recipes are refused."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.cli import build_parser, main
from llmopt.compress.prune import load_pruned
from llmopt.models.packed.metadata import compression_metadata
from llmopt.recipe import Recipe, RecipeError, run_recipe


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir):
    return tiny_hf_dir("tiny", seed=2, tie_embeddings=True)


def _recipe(model_dir, out, stages):
    return {
        "model": str(model_dir),
        "out": str(out),
        "eval": {"max_tokens": 128, "ctx": 64, "decode_tokens": 6, "decode": "eager"},
        "stage": stages,
    }


@pytest.mark.slow
def test_chain_writes_and_measures_each_intermediate(model_dir, tmp_path):
    stages = [
        {"kind": "prune", "method": "magnitude", "sparsity": "2:4"},
        {"kind": "distill", "steps": 2, "seq_len": 16, "max_chars": 20_000, "lr": 1e-3},
        {"kind": "quantize", "method": "rtn", "bits": 4, "group_size": 32},
    ]
    out = tmp_path / "out"
    rows = run_recipe(Recipe.from_dict(_recipe(model_dir, out, stages)), log=lambda _: None)
    assert [r["stage"] for r in rows] == [
        "original", "prune", "prune+distill", "prune+distill+quantize"
    ]  # fmt: skip
    assert rows[0]["kl_vs_original"] == pytest.approx(0, abs=1e-6)
    assert rows[0]["top1_vs_original"] == 1.0
    for i, row in enumerate(rows[1:], 1):
        kind = row["stage"].split("+")[-1]
        saved = json.loads((out / f"{i:02d}-{kind}.metrics.json").read_text())
        assert saved["stage"] == row["stage"] and saved["ppl"] == row["ppl"]
        assert row["kl_vs_original"] > 0 and row["disk_bytes"] > 0
        assert row["decode_tokens_per_s"] > 0 and row["decode_path"] == "eager"
    summary = json.loads((out / "recipe_metrics.json").read_text())
    assert [r["stage"] for r in summary["rows"]] == [r["stage"] for r in rows]
    assert (out / "02-distill" / "train_log.jsonl").is_file()
    # the distilled weights changed, and keep the 2:4 pattern of the pruned stage
    pruned = load_pruned(rows[1]["model"], packed=False)
    distilled = load_pruned(rows[2]["model"], packed=False)
    assert (
        compression_metadata(pruned).prune_masks.keys()
        == compression_metadata(distilled).prune_masks.keys()
    )
    changed = 0
    for name, keep in compression_metadata(pruned).prune_masks.items():
        w = distilled.get_submodule(name).weight
        assert torch.equal(compression_metadata(distilled).prune_masks[name], keep)
        assert not w[~keep].any()
        changed += int(not torch.equal(w, pruned.get_submodule(name).weight))
    assert changed == len(compression_metadata(pruned).prune_masks)
    assert (out / "03-quantize" / "llmopt_quant.json").is_file()


def test_bad_recipes_are_refused_with_the_key_named(model_dir, tmp_path):
    ok = [{"kind": "quantize"}]
    for data, match in [
        (_recipe(model_dir, tmp_path / "o", [{"kind": "shrink"}]), "kind='shrink' is not one of"),
        (_recipe(model_dir, tmp_path / "o", [{"kind": "prune", "bits": 4}]), "unknown key 'bits'"),
        (_recipe(model_dir, tmp_path / "o", []), "has no"),
        (_recipe(model_dir, tmp_path / "o", [{"kind": "prune", "sparsity": "1.5"}]), "1.5"),
        (_recipe(model_dir, tmp_path / "o", [{"kind": "prune", "sparsity": "4:4"}]), "N < M"),
        (_recipe(model_dir, tmp_path / "o", [{"kind": "distill", "alpha": 2}]), "alpha=2"),
        (_recipe(model_dir, model_dir, ok), "is the source model"),
        (_recipe(model_dir, model_dir / "inside", ok), "is the source model"),
        ({**_recipe(model_dir, tmp_path / "o", ok), "extra": 1}, "unknown recipe key 'extra'"),
        ({**_recipe(model_dir, tmp_path / "o", ok), "eval": {"decode": "jit"}}, "decode='jit'"),
    ]:
        with pytest.raises(RecipeError, match=match):
            Recipe.from_dict(data)
    bad = tmp_path / "r.toml"
    bad.write_text(f'model = "{model_dir}"\nout = "{tmp_path / "o"}"\n[[stage]]\nkind = "x"\n')
    assert main(["compress", "--recipe", str(bad)]) == 2
    assert main(["compress", "--recipe", str(tmp_path / "missing.toml")]) == 2


def test_stages_are_the_commands_own_config_objects(model_dir, tmp_path):
    from llmopt.compress.cli import quant_config
    from llmopt.compress.prune.cli import prune_config
    from llmopt.recipe.config import DistillStage, FuseStage

    stages = [
        {"kind": "prune"},
        {"kind": "quantize", "group_size": 64, "lm_head": True, "calib_samples": 8},
        {"kind": "distill"},
        {"kind": "fuse"},
    ]
    recipe = Recipe.from_dict(_recipe(model_dir, tmp_path / "o", stages))
    prune_args = build_parser("prune").parse_args(["prune", "--out", "x"])
    quant_args = build_parser("quantize").parse_args(
        ["quantize", "--out", "x", "--group-size", "64", "--lm-head", "--calib-samples", "8"]
    )
    assert recipe.stages == [
        prune_config(prune_args),
        quant_config(quant_args),  # awq, as `llmopt quantize`
        DistillStage(),
        FuseStage(),
    ]


def test_an_older_recipe_key_is_refused_naming_the_new_one(model_dir, tmp_path):
    old = [{"kind": "quantize", "method": "awq", "calib_tokens": 4096}]
    with pytest.raises(RecipeError, match="'calib_tokens' is now called calib_samples"):
        Recipe.from_dict(_recipe(model_dir, tmp_path / "o", old))
