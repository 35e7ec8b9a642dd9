"""docs/configs/ holds what `llmopt plan --emit` writes today, and every file passes its
framework's own validation: Megatron-Core's TransformerConfig for the Megatron-LM and NeMo
lines, DeepSpeed's own config classes and launcher parser, torchtitan's JobConfig fields
(pinned names: torchtitan's parser needs its training stack), llmopt's ParallelPlan."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.cli import main
from llmopt.parallel.plan import ParallelPlan
from tests.paths import REPO

DOCS = REPO / "docs" / "configs"
MOE = ["--model", "deepseek-v3", "--cluster", "dgx-b200", "--nodes", "32", "--precision", "fp8",
       "--ep-dispatcher", "hybridep"]  # fmt: skip
# file -> (the plan arguments before --emit, side files): the commands docs/configs/README.md lists
EMITTED = {
    "llama-3-70b.run.toml": (["--pick", "4"], []),  # the best plan the trainer runs as written
    "llama-3-70b.megatron.sh": (["--framework", "megatron"], []),
    "llama-3-70b.nemo.sh": (["--framework", "nemo"], []),
    "llama-3-70b.torchtitan.toml": (["--framework", "torchtitan"], []),
    "llama-3-70b.deepspeed.json": (
        ["--framework", "deepspeed"],
        ["llama-3-70b.deepspeed.launch.sh"],
    ),  # fmt: skip
    "deepseek-v3.megatron.sh": ([*MOE, "--framework", "megatron"], []),
    "deepseek-v3.nemo.sh": ([*MOE, "--framework", "nemo"], []),
}


def command(name: str) -> str:
    args, _ = EMITTED[name]
    return shlex.join(["llmopt", "plan", *args, "--emit", f"docs/configs/{name}"])


def test_docs_list_every_emitted_file():
    readme = (DOCS / "README.md").read_text()
    for name in EMITTED:
        assert f"`{command(name)}`" in readme, command(name)
    listed = {p.name for p in DOCS.iterdir()} - {"README.md"}
    assert listed == set(EMITTED) | {s for _, sides in EMITTED.values() for s in sides}


@pytest.mark.parametrize("name", sorted(EMITTED))
def test_docs_configs_are_what_emit_writes(name, tmp_path, capsys):
    args, sides = EMITTED[name]
    assert main(["plan", *args, "--top-k", "1", "--emit", str(tmp_path / name)]) == 0
    capsys.readouterr()
    for file in [name, *sides]:
        assert (tmp_path / file).read_text() == (DOCS / file).read_text(), file


def _last_line_argv(path: Path) -> tuple[dict[str, str], list[str]]:
    argv = shlex.split(path.read_text().splitlines()[-1].replace('"$', "$"))
    env = {}
    while "=" in argv[0]:
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return env, argv


@pytest.mark.parametrize("name", [n for n in EMITTED if n.endswith(".megatron.sh")])
def test_megatron_files_pass_megatron_cores_validation(name, monkeypatch):
    import megatron.core.transformer.transformer_config as tc
    from framework_checks import MEGATRON_FLAGS, megatron_core_config
    from packaging.version import Version

    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(tc, "get_te_version", lambda: Version("2.9.0"))
    env, argv = _last_line_argv(DOCS / name)
    argv = argv[argv.index("pretrain_gpt.py") + 1 :]
    assert {t for t in argv if t.startswith("--")} <= MEGATRON_FLAGS
    config = megatron_core_config(argv)
    if "deepseek" in name:
        assert config.num_moe_experts == 256 and config.mtp_num_layers == 1
    if config.tensor_model_parallel_size > 1 and "B200" not in (DOCS / name).read_text():
        fsdp = "--use-megatron-fsdp" in argv
        assert (env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") != fsdp


@pytest.mark.parametrize("name", [n for n in EMITTED if n.endswith(".nemo.sh")])
def test_nemo_files_pass_megatron_cores_validation(name, monkeypatch):
    """The recipe's model (shapes from the preset) with the emitted model.* overrides is a valid
    Megatron-Core TransformerConfig."""
    import megatron.core.transformer.transformer_config as tc
    from framework_checks import megatron_core_config
    from packaging.version import Version

    from llmopt.models.presets import get_preset

    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(tc, "get_te_version", lambda: Version("2.9.0"))
    _, argv = _last_line_argv(DOCS / name)
    pairs = dict(t.split("=", 1) for t in argv if t.startswith("model."))
    model = get_preset(name.split(".")[0])
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_heads)]  # fmt: skip
    if model.moe is not None:
        flags += ["--num-experts", str(model.moe.num_experts), "--moe-router-topk",
                  str(model.moe.top_k), "--mtp-num-layers", str(model.moe.mtp_layers)]  # fmt: skip
    for key, value in pairs.items():
        flag = "--" + key.removeprefix("model.").replace("_", "-")
        flag = {"--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank"
                }.get(flag, flag)  # fmt: skip
        if value in ("true", "false", "null"):
            flags += [flag] if value == "true" else []
        else:
            flags += [flag, value]
    config = megatron_core_config(flags)
    assert config.pipeline_model_parallel_size == int(pairs["model.pipeline_model_parallel_size"])


def test_deepspeed_file_passes_deepspeeds_own_checks():
    from framework_checks import DS_CHECK

    cfg = DOCS / "llama-3-70b.deepspeed.json"
    launcher = (DOCS / "llama-3-70b.deepspeed.launch.sh").read_text().splitlines()[-1]
    c = json.loads(cfg.read_text())  # the data-parallel size the batch fields imply
    dp = c["train_batch_size"] // (
        c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"]
    )
    out = subprocess.run([sys.executable, "-c", DS_CHECK, json.dumps([[str(cfg), dp, launcher]])],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


def test_torchtitan_file_uses_job_config_fields_and_run_config_is_a_plan():
    import tomllib
    from framework_checks import TORCHTITAN_FIELDS, TORCHTITAN_LITERALS

    doc = tomllib.loads((DOCS / "llama-3-70b.torchtitan.toml").read_text())
    for section, body in doc.items():
        assert set(body) <= TORCHTITAN_FIELDS[section], (section, set(body))
    for (section, key), valid in TORCHTITAN_LITERALS.items():
        if key in doc.get(section, {}):
            assert doc[section][key] in valid
    plan = ParallelPlan.from_file(DOCS / "llama-3-70b.run.toml")
    assert plan.world_size == 64
