"""`llmopt plan --emit`: llmopt's run config, and the same plan for Megatron-LM, NeMo /
Megatron-Bridge, torchtitan and DeepSpeed, each checked against that framework's own option
names (and, for DeepSpeed, its own config classes), with clear refusals of what it cannot
express."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from llmopt.cli import main
from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.emit import (
    EmitError,
    PlannedRun,
    emit,
    format_for,
    megatron,
    nemo,
    torchtitan,
    write,
)
from llmopt.plan.emit import deepspeed as ds
from llmopt.plan.emit.runconfig import run_config
from llmopt.plan.hardware import get_cluster
from llmopt.plan.predict import predicted_comm
from llmopt.plan.search import estimate
from llmopt.plan.workload import Workload

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MODEL = get_preset("llama-3-70b")
WORK = Workload()
CLUSTER = get_cluster("dgx-h100", 8)
TOP = dict(tp=4, pp=4, dp=4, sequence_parallel=True, zero_stage=1, num_microbatches=256,
           schedule="interleaved", virtual_stages=2)  # fmt: skip


def _run(model_name: str = "llama-3-70b", work: Workload = WORK, **fields) -> PlannedRun:
    par = ParallelPlan(**fields)
    # pipelined ZeRO-2/3: the gradient policy torch.distributed.pipelining runs (torchtitan)
    policy = "step" if par.pp > 1 and par.zero_stage >= 2 else "microbatch"
    plan = estimate(get_preset(model_name), work, CLUSTER, par, grad_reduce=policy)
    assert not plan.rejected, plan.rejected
    plan.rank = 1
    return PlannedRun(get_preset(model_name), model_name, work, CLUSTER, plan)


def test_format_from_file_name():
    assert format_for("run.toml") == format_for("run.json") == "llmopt"
    assert format_for("x.megatron.sh") == "megatron"
    assert format_for("llama.deepspeed.json") == "deepspeed"
    assert format_for("a.json", "torchtitan") == "torchtitan"
    with pytest.raises(EmitError, match="--emit-format='slurm' is not valid"):
        format_for("a.toml", "slurm")
    with pytest.raises(EmitError, match="cannot tell which framework launch.sh is for"):
        format_for("launch.sh")


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_run_config_round_trips_and_carries_predicted_bytes(tmp_path, suffix):
    run = _run(**TOP)
    path = tmp_path / f"run{suffix}"
    assert write(run, path) == [path]
    text = path.read_text()
    data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    assert set(data) == {"model", "data", "parallel", "planner"}
    assert data["model"] == {"model": "llama-3-70b"}
    assert data["data"] == {"seq_len": 4096, "global_batch": 1024}
    assert ParallelPlan.from_file(path) == run.parallel
    assert data["parallel"] == run.parallel.to_dict()
    planner = data["planner"]
    assert planner["cluster"] == {"name": "dgx-h100", "gpu": "H100-SXM5-80GB", "nodes": 8,
                                  "gpus_per_node": 8}  # fmt: skip
    assert planner["step_time_s"]["total"] == pytest.approx(run.plan.step_time_s["total"], 1e-6)
    for stage in ("first", "last"):
        assert planner["comm"][stage] == predicted_comm(MODEL, 4096, 1024, run.parallel, stage)
    # the first stage of tp=4 pp=4 dp=4 reduce-scatters and all-gathers over DP once (ZeRO-1)
    assert planner["comm"]["first"]["dp"]["reduce_scatter"]["calls"] == 1
    assert list(tmp_path.iterdir()) == [path]  # built aside, nothing left behind


def test_run_config_refuses_what_the_trainer_cannot_read():
    run = _run(**TOP)
    custom = PlannedRun(run.model, "configs/my_model.json", WORK, CLUSTER, run.plan)
    with pytest.raises(EmitError, match="a run config names a model preset, got 'configs/my"):
        run_config(custom)
    vocab = PlannedRun(run.model, "llama-3-70b", WORK, CLUSTER, run.plan, {"vocab_size": 99})
    with pytest.raises(EmitError, match="the trainer cannot override vocab_size"):
        run_config(vocab)


# Megatron-LM option strings and choices, from the argparse parser that
# megatron/training/arguments.py builds (NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553,
# flags generated from TransformerConfig/ModelParallelConfig included): only those used here.
MEGATRON_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
    "--group-query-attention", "--num-query-groups", "--kv-channels", "--seq-length",
    "--max-position-embeddings", "--position-embedding-type", "--rotary-base", "--normalization",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--tokenizer-type", "--vocab-size", "--mock-data", "--micro-batch-size",
    "--global-batch-size", "--train-iters", "--lr", "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--context-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--bf16",
    "--fp8-format", "--fp8-recipe", "--grad-reduce-in-bf16",
}  # fmt: skip
MEGATRON_CHOICES = {
    "--position-embedding-type": {"learned_absolute", "rope", "yarn", "mrope", "relative", "none"},
    "--normalization": {"LayerNorm", "RMSNorm"},
    "--recompute-granularity": {"full", "selective"},
    "--recompute-method": {"uniform", "block"},
    "--fp8-format": {"e4m3", "hybrid"},
    "--fp8-recipe": {"tensorwise", "delayed", "mxfp8", "blockwise", "custom"},
    "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
    "--ckpt-format": {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"},
    "--tokenizer-type": {"NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"},
}  # fmt: skip

VARIANTS = [
    TOP,
    dict(
        tp=8,
        pp=1,
        dp=4,
        cp=2,
        sequence_parallel=True,
        zero_stage=3,
        num_microbatches=256,
        recompute="full",
        precision="fp8",
        fp8_recipe="delayed",
    ),  # fmt: skip
    dict(
        tp=8,
        pp=1,
        dp=8,
        sequence_parallel=True,
        zero_stage=2,
        num_microbatches=128,
        recompute="selective",
        precision="fp8",
        reduce_dtype="bf16",
    ),  # fmt: skip
]


def _megatron_args(run: PlannedRun) -> dict[str, str | None]:
    argv = shlex.split(emit(run, "megatron").text.splitlines()[-1].replace('"$', "$"))
    assert argv[:2] == ["torchrun", "--nnodes"]
    argv = argv[argv.index("pretrain_gpt.py") + 1 :]
    out: dict[str, str | None] = {}
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[tok] = None if nxt is None or nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize("fields", VARIANTS)
def test_megatron_arguments_are_megatrons_own(fields):
    run = _run(**fields)
    args = _megatron_args(run)
    assert set(args) <= MEGATRON_FLAGS, set(args) - MEGATRON_FLAGS
    for flag, valid in MEGATRON_CHOICES.items():
        if flag in args:
            assert args[flag] in valid, (flag, args[flag])
    p = run.parallel
    assert args["--tensor-model-parallel-size"] == str(p.tp)
    assert args["--pipeline-model-parallel-size"] == str(p.pp)
    assert args["--micro-batch-size"] == str(p.micro_batch)
    assert args["--global-batch-size"] == "1024"
    assert ("--sequence-parallel" in args) == p.sequence_parallel
    assert ("--use-distributed-optimizer" in args) == (p.zero_stage == 1)
    assert ("--grad-reduce-in-bf16" in args) == (p.reduce_dtype == "bf16")
    if p.zero_stage >= 2:
        want = {2: "optim_grads", 3: "optim_grads_params"}[p.zero_stage]
        assert args["--data-parallel-sharding-strategy"] == want
    if p.precision == "fp8":
        assert args["--fp8-recipe"] == {"current": "tensorwise", "delayed": "delayed"}[p.fp8_recipe]
    if p.cp > 1:
        assert args["--context-parallel-size"] == str(p.cp)


# Megatron-Bridge ConfigContainer override keys (NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a:
# src/megatron/bridge/training/config.py sections, Megatron-Core's ModelParallelConfig /
# TransformerConfig / DistributedDataParallelConfig fields, registered mixed-precision recipes in
# training/mixed_precision.py, recipe names exported by recipes/llama/llama3.py).
BRIDGE_KEYS = {
    "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size", "model.context_parallel_size",
    "model.sequence_parallel", "model.recompute_granularity", "model.recompute_method",
    "model.recompute_num_layers", "dataset.seq_length", "train.micro_batch_size",
    "train.global_batch_size", "ddp.use_distributed_optimizer", "ddp.use_megatron_fsdp",
    "ddp.data_parallel_sharding_strategy", "checkpoint.ckpt_format", "mixed_precision",
}  # fmt: skip
BRIDGE_MIXED = {"bf16_mixed", "bf16_with_fp8_current_scaling_mixed",
                "bf16_with_fp8_delayed_scaling_mixed"}  # fmt: skip
BRIDGE_RECIPES = {"llama3_8b_pretrain_config", "llama3_70b_pretrain_config",
                  "llama31_8b_pretrain_config", "llama31_70b_pretrain_config",
                  "llama31_405b_pretrain_config"}  # fmt: skip


@pytest.mark.parametrize("fields", VARIANTS[:2])
def test_nemo_overrides_are_bridge_config_fields(fields):
    run = _run(**fields)
    argv = shlex.split(emit(run, "nemo").text.splitlines()[-1])
    i = argv.index("scripts/training/run_recipe.py")
    assert argv[i + 1 : i + 6] == ["--recipe", "llama3_70b_pretrain_config", "--mode", "pretrain",
                                   "--dataset"]  # fmt: skip
    assert argv[i + 2] in BRIDGE_RECIPES
    pairs = dict(tok.split("=", 1) for tok in argv[i + 7 :])
    assert set(pairs) <= BRIDGE_KEYS, set(pairs) - BRIDGE_KEYS
    assert pairs["mixed_precision"] in BRIDGE_MIXED
    p = run.parallel
    assert pairs["model.tensor_model_parallel_size"] == str(p.tp)
    assert pairs["model.sequence_parallel"] == str(p.sequence_parallel).lower()
    assert pairs["train.global_batch_size"] == "1024"


# torchtitan JobConfig sections and fields (torchtitan/config/job_config.py at
# pytorch/torchtitan@238fa9953e4aec2a62582121564273d7cbb1e9f1): only those used here, with the
# Literal values they allow.
TORCHTITAN_FIELDS = {
    "job": {"description"},
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param",
                 "mixed_precision_reduce"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "quantize": {"linear"},
}  # fmt: skip
TORCHTITAN_LITERALS = {
    ("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
    ("activation_checkpoint", "mode"): {"selective", "full", "memory_budget", "none"},
    ("training", "mixed_precision_param"): {"bfloat16", "float32"},
    ("training", "mixed_precision_reduce"): {"float32"},
}


@pytest.mark.parametrize(
    "fields",
    [
        dict(
            tp=2,
            pp=8,
            dp=4,
            sequence_parallel=True,
            zero_stage=2,
            num_microbatches=256,
            recompute="selective",
        ),  # fmt: skip
        dict(
            tp=8,
            pp=1,
            dp=4,
            cp=2,
            sequence_parallel=True,
            zero_stage=3,
            num_microbatches=256,
            recompute="selective",
            precision="fp8",
        ),  # fmt: skip
        dict(
            tp=2,
            pp=4,
            dp=8,
            sequence_parallel=True,
            zero_stage=3,
            num_microbatches=128,
            schedule="interleaved",
            virtual_stages=5,
            recompute="full",
        ),  # fmt: skip
    ],
)
def test_torchtitan_job_config_uses_job_config_fields(fields):
    from torch.distributed.pipelining.schedules import get_schedule_class

    run = _run(**fields)
    doc = tomllib.loads(emit(run, "torchtitan").text)
    for section, body in doc.items():
        assert set(body) <= TORCHTITAN_FIELDS[section], (section, set(body))
    for (section, key), valid in TORCHTITAN_LITERALS.items():
        if key in doc[section]:
            assert doc[section][key] in valid
    par, p = doc["parallelism"], run.parallel
    n = 1
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):  # fmt: skip
        n *= par[key]
    assert n == p.world_size == 64
    if p.pp > 1:
        get_schedule_class(par["pipeline_parallel_schedule"])  # a schedule torch knows
        # torchtitan derives ceil(layers / layers_per_stage) stages: pp * virtual_stages of them
        assert (
            -(-MODEL.num_layers // par["pipeline_parallel_layers_per_stage"])
            == p.pp * p.virtual_stages
        )
        assert doc["training"]["local_batch_size"] == p.micro_batch * p.num_microbatches
    else:
        assert doc["training"]["local_batch_size"] == p.micro_batch
    assert (
        doc["parallelism"]["fsdp_reshard_after_forward"] == {2: "never", 3: "always"}[p.zero_stage]
    )
    if p.precision == "fp8":
        assert doc["model"]["converters"] == ["float8"]


@pytest.mark.parametrize(
    "module, fields, message",
    [
        (megatron, dict(TOP, schedule="gpipe", virtual_stages=1), "Megatron-LM cannot express schedule=gpipe"),
        (megatron, dict(TOP, virtual_stages=6), "num_layers=80 split over pp\\*virtual_stages=24 unevenly"),  # fmt: skip
        (nemo, dict(TOP, reduce_dtype="bf16"), "Megatron-Bridge cannot express reduce_dtype=bf16"),
        (torchtitan, TOP, "torchtitan cannot express zero_stage=1"),
        (torchtitan, dict(TOP, zero_stage=0), "zero_stage=0 with tp=4,pp=4,dp=4"),
        (torchtitan, dict(TOP, zero_stage=3, sequence_parallel=False), "tp>1 without sequence_parallel"),
        (torchtitan, dict(TOP, zero_stage=3, precision="fp8", fp8_recipe="delayed"), "fp8_recipe=delayed"),
        (ds, dict(TOP, zero_stage=2), "DeepSpeed cannot express zero_stage=2 with pp=4"),
        (ds, dict(TOP, schedule="1f1b", virtual_stages=1), "AutoTP \\(tp>1\\) inside its pipeline"),
        (ds, dict(tp=8, pp=1, dp=4, cp=2, zero_stage=1, num_microbatches=256), "cp=2"),
        (ds, dict(tp=8, pp=1, dp=8, sequence_parallel=True, zero_stage=1, num_microbatches=128),
         "Megatron-style sequence_parallel"),  # fmt: skip
        (ds, dict(tp=8, pp=1, dp=8, zero_stage=1, num_microbatches=128, precision="fp8"), "precision=fp8"),
    ],
)  # fmt: skip
def test_refusals_name_what_the_framework_cannot_express(module, fields, message):
    par = ParallelPlan(**fields)
    policy = "step" if par.pp > 1 and par.zero_stage >= 2 else "microbatch"  # as _run
    plan = estimate(MODEL, WORK, CLUSTER, par, grad_reduce=policy)
    run = PlannedRun(MODEL, "llama-3-70b", WORK, CLUSTER, plan)
    with pytest.raises(EmitError, match=message) as info:
        module.emit(run)
    assert "\n" not in str(info.value)


def test_unknown_model_is_refused_by_recipe_based_frameworks():
    run = _run("qwen2.5-7b", tp=4, pp=1, dp=16, sequence_parallel=True, zero_stage=3,
               num_microbatches=64)  # fmt: skip
    with pytest.raises(EmitError, match="no pretraining recipe for it"):
        nemo.emit(run)
    with pytest.raises(EmitError, match="no llama3 flavor for it"):
        torchtitan.emit(run)
    assert "--num-layers 28" in megatron.emit(run).text  # Megatron takes the shape itself


DS_CHECK = r"""
import json, sys
import deepspeed.runtime.config as dsc
from deepspeed.runtime import constants
from deepspeed.launcher.runner import parse_args

dsc.dist.get_rank = lambda *a, **k: 0  # no process group: DeepSpeedConfig only asks the rank
known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
known |= {"zero_optimization", "tensor_parallel", "activation_checkpointing"}


class MPU:  # the data-parallel size is what DeepSpeed checks the batch against
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


for path, dp, launcher in json.loads(sys.argv[1]):
    cfg = json.load(open(path))
    unknown = set(cfg) - known
    assert not unknown, unknown
    c = dsc.DeepSpeedConfig(cfg, mpu=MPU(dp))
    args = parse_args(launcher.split()[1:])
    print(json.dumps({"batch": c.train_batch_size, "gas": c.gradient_accumulation_steps,
                      "zero": c.zero_optimization_stage, "tp": c.tensor_parallel_config.autotp_size,
                      "nodes": args.num_nodes, "gpus": args.num_gpus, "script": args.user_script}))
"""


def test_deepspeed_config_is_accepted_by_deepspeed(tmp_path):
    runs = [
        _run(tp=1, pp=8, dp=8, zero_stage=1, num_microbatches=128, recompute="full"),
        _run(tp=8, pp=1, dp=8, zero_stage=3, micro_batch=2, num_microbatches=64, recompute="full"),
    ]
    jobs = []
    for i, run in enumerate(runs):
        written = write(run, tmp_path / f"ds{i}.deepspeed.json")
        assert [p.name for p in written] == [f"ds{i}.deepspeed.json", f"ds{i}.deepspeed.launch.sh"]
        launcher = written[1].read_text().splitlines()[-1]
        jobs.append([str(written[0]), run.parallel.dp, launcher])
    out = subprocess.run([sys.executable, "-c", DS_CHECK, json.dumps(jobs)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert got == [  # autotp_size 0: DeepSpeed's "AutoTP off"
        {
            "batch": 1024,
            "gas": 128,
            "zero": 1,
            "tp": 0,
            "nodes": 8,
            "gpus": 8,
            "script": "train.py",
        },
        {"batch": 1024, "gas": 64, "zero": 3, "tp": 8, "nodes": 8, "gpus": 8, "script": "train.py"},
    ]


def test_cli_emit_names_the_best_plan_a_framework_can_express(tmp_path, capsys):
    path = tmp_path / "t.torchtitan.toml"
    assert main(["plan", "--emit", str(path), "--top-k", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmopt plan: error: plan #1: torchtitan cannot express zero_stage=1")
    assert err.endswith("the best plan it can express is #6: use --pick 6")
    assert not path.exists()
    assert main(["plan", "--emit", str(path), "--pick", "6", "--top-k", "1"]) == 0
    assert f"wrote {path} (plan #6)" in capsys.readouterr().out
    assert tomllib.loads(path.read_text())["job"]["description"].startswith("llmopt plan #6")
    assert main(["plan", "--emit", str(path), "--pick", "999999"]) == 2
    assert "rank 999999 is not valid" in capsys.readouterr().err
