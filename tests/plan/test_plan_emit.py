"""`llmopt plan --emit`: llmopt's run config, and the same plan for Megatron-LM, NeMo /
Megatron-Bridge, torchtitan and DeepSpeed, each checked against that framework's own option
names (and, for DeepSpeed, its own config classes), with clear refusals of what it cannot
express."""

from __future__ import annotations

import json
import re
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
from tests.framework_checks import (  # noqa: E402  (a helper module beside the tests)
    DS_CHECK,
    MEGATRON_CHOICES,
    MEGATRON_FLAGS,
    TORCHTITAN_FIELDS,
    TORCHTITAN_LITERALS,
    megatron_core_config,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MODEL = get_preset("llama-3-70b")
WORK = Workload()
CLUSTER = get_cluster("dgx-h100", 8)
TOP = dict(tp=4, pp=4, dp=4, sequence_parallel=True, zero_stage=1, num_microbatches=256,
           schedule="interleaved", virtual_stages=2)  # fmt: skip


def _planned(model_name: str, work: Workload, cluster, fields: dict) -> PlannedRun:
    """The planner's estimate of the plan `fields` (not checked: refusals want bad ones)."""
    par = ParallelPlan(**fields)
    # pipelined ZeRO-2/3: the gradient policy torch.distributed.pipelining runs (torchtitan)
    policy = "step" if par.pp > 1 and par.zero_stage >= 2 else "microbatch"
    plan = estimate(get_preset(model_name), work, cluster, par, grad_reduce=policy)
    return PlannedRun(get_preset(model_name), model_name, work, cluster, plan)


def _run(
    model_name: str = "llama-3-70b", work: Workload = WORK, cluster=CLUSTER, **fields
) -> PlannedRun:
    """The plan `fields` as the planner's top-ranked, valid run."""
    run = _planned(model_name, work, cluster, fields)
    assert not run.plan.rejected, run.plan.rejected
    run.plan.rank = 1
    return run


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


VARIANTS = [
    TOP,
    dict(tp=8, pp=1, dp=4, cp=2, sequence_parallel=True, zero_stage=3, num_microbatches=256, recompute="full", precision="fp8", fp8_recipe="delayed"),
    dict(tp=8, pp=1, dp=8, sequence_parallel=True, zero_stage=2, num_microbatches=128, recompute="selective", precision="fp8", reduce_dtype="bf16"),
]  # fmt: skip
TORCHTITAN_VARIANTS = [
    dict(tp=2, pp=8, dp=4, sequence_parallel=True, zero_stage=2, num_microbatches=256, recompute="selective"),
    dict(tp=8, pp=1, dp=4, cp=2, sequence_parallel=True, zero_stage=3, num_microbatches=256, recompute="selective", precision="fp8"),
    dict(tp=2, pp=4, dp=8, sequence_parallel=True, zero_stage=3, num_microbatches=128, schedule="interleaved", virtual_stages=2, recompute="full"),
]  # fmt: skip


def _megatron_argv(run: PlannedRun) -> tuple[dict[str, str], list[str]]:
    """(environment, pretrain_gpt.py arguments) of the emitted line."""
    argv = shlex.split(emit(run, "megatron").text.splitlines()[-1].replace('"$', "$"))
    env = {}
    while "=" in argv[0]:
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    assert argv[:2] == ["torchrun", "--nnodes"]
    return env, argv[argv.index("pretrain_gpt.py") + 1 :]


def _megatron_args(run: PlannedRun) -> dict[str, str | None]:
    _, argv = _megatron_argv(run)
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
    # uneven splits, TP overlap, gradient-reduce dtype (training/config.py ConfigContainer:
    # comm_overlap = CommOverlapConfig, mixed_precision = MixedPrecisionConfig), MoE fields
    "model.pipeline_model_parallel_layout", "model.account_for_embedding_in_pipeline_split",
    "model.account_for_loss_in_pipeline_split", "comm_overlap.tp_comm_overlap",
    "ddp.grad_reduce_in_fp32", "mixed_precision.grad_reduce_in_fp32",
    "model.expert_model_parallel_size", "model.expert_tensor_parallel_size",
    "model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend",
    "model.overlap_moe_expert_parallel_comm",
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


@pytest.mark.parametrize("fields", TORCHTITAN_VARIANTS)
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
        # torchtitan derives ceil((layers + 1 + 1) / layers_per_stage) stages (embedding and
        # output weighted as a layer each): pp * virtual_stages of them
        weights = par["pipeline_parallel_first_stage_less_layers"]
        weights += par["pipeline_parallel_last_stage_less_layers"]
        assert (
            -(-(MODEL.num_layers + weights) // par["pipeline_parallel_layers_per_stage"])
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
        (torchtitan, dict(TOP, zero_stage=3, virtual_stages=8), "torchtitan cannot express num_layers=80 over 32 pipeline stages"),  # fmt: skip
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
    run = _planned("llama-3-70b", WORK, CLUSTER, fields)
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
    assert err.startswith("llmopt plan: error: plan #1: torchtitan cannot express ")
    best = re.search(r"the best plan it can express is #(\d+): use --pick (\d+)$", err)
    assert best and best.group(1) == best.group(2), err
    pick = best.group(1)
    assert not path.exists()
    assert main(["plan", "--emit", str(path), "--pick", pick, "--top-k", "1"]) == 0
    assert f"wrote {path} (plan #{pick})" in capsys.readouterr().out
    doc = tomllib.loads(path.read_text())
    assert doc["job"]["description"].startswith(f"llmopt plan #{pick}")
    assert main(["plan", "--emit", str(path), "--pick", "999999"]) == 2
    assert "rank 999999 is not valid" in capsys.readouterr().err


MOE_WORK = Workload(seq_len=4096, global_batch=2048, precision="fp8", ep_dispatcher="hybridep")


def _moe_run(model_name, cluster, folded_ep, work=MOE_WORK, **fields) -> PlannedRun:
    par = ParallelPlan(**fields)
    model = get_preset(model_name)
    plan = estimate(model, work, cluster, par, etp=1, ep=folded_ep)
    assert not plan.rejected, plan.rejected
    assert plan.ep == folded_ep
    plan.rank = 1
    return PlannedRun(model, model_name, work, cluster, plan)


W405 = Workload(seq_len=8192, global_batch=512, precision="fp8", tp_comm_overlap=True)
PLAN_405B = dict(tp=8, pp=8, dp=8, cp=2, sequence_parallel=True, zero_stage=1, num_microbatches=64,
                 schedule="interleaved", virtual_stages=8, precision="fp8", reduce_dtype="bf16")  # fmt: skip


# NeMo's recipe recomputes selectively (Megatron-Bridge v0.2.1 scripts/performance/configs/
# deepseek: recompute_granularity="selective"); with E+4 on the first of 16 stages (its layout)
# the run does not fit without
DSV3 = dict(tp=1, pp=16, dp=16, ep=8, zero_stage=1, num_microbatches=128, precision="fp8",
            recompute="selective")  # fmt: skip
QWEN3 = dict(tp=2, pp=8, dp=16, ep=1, sequence_parallel=True, zero_stage=1, num_microbatches=128,
             schedule="interleaved", virtual_stages=4, recompute="selective")  # fmt: skip
QWEN3_WORK = Workload(seq_len=4096, global_batch=2048, ep_comm_overlap=True)


def _megatron_runs() -> list[PlannedRun]:
    h100_128 = get_cluster("dgx-h100", 128)
    return [
        *(_run(**v) for v in VARIANTS),
        _run(**dict(TOP, virtual_stages=6)),  # 80 layers over 24 chunks: uneven, a layout
        _run("llama-3.1-405b", W405, h100_128, **PLAN_405B),
        _moe_run("deepseek-v3", get_cluster("dgx-b200", 32), 8, **DSV3),
        _moe_run("qwen3-235b-a22b", get_cluster("dgx-h100", 32), 32, work=QWEN3_WORK, **QWEN3),
    ]


def test_megatron_lines_pass_megatron_cores_own_validation(monkeypatch):
    import megatron.core.transformer.transformer_config as tc
    from packaging.version import Version

    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(tc, "get_te_version", lambda: Version("2.9.0"))
    for run in _megatron_runs():
        env, argv = _megatron_argv(run)
        flags = {t for t in argv if t.startswith("--")}
        assert flags <= MEGATRON_FLAGS, flags - MEGATRON_FLAGS
        config = megatron_core_config(argv)
        p = run.parallel
        assert config.num_layers == run.model.num_layers
        assert config.pipeline_model_parallel_size == p.pp
        if run.model.moe is not None:  # the experts travel with the plan
            assert config.num_moe_experts == run.model.moe.num_experts
            assert config.expert_model_parallel_size == run.plan.ep
            assert config.moe_router_topk == run.model.moe.top_k
        if run.model.name == "deepseek-v3":
            assert config.mtp_num_layers == 1 and config.q_lora_rank == 1536
            assert config.moe_layer_freq == [0] * 3 + [1] * 58
        # what Megatron's validate_args asserts about the environment (before Blackwell)
        if (p.tp > 1 or p.cp > 1) and p.zero_stage < 2 and not run.work.ep_comm_overlap:
            assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" or "B200" in run.cluster.gpu.name
        else:
            assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"
    # and Megatron-Core refuses what is wrong: a layout that loses a layer
    bad = _megatron_argv(_run(**dict(TOP, virtual_stages=6)))[1]
    i = bad.index("--pipeline-model-parallel-layout")
    bad[i + 1] = bad[i + 1].replace("t", "", 1)
    with pytest.raises((ValueError, AssertionError)):
        megatron_core_config(bad)


def test_emitted_moe_plans_carry_their_experts():
    run = _megatron_runs()[-2]  # DeepSeek-V3 on 256 B200
    nemo_argv = shlex.split(emit(run, "nemo").text.splitlines()[-1])
    assert "deepseek_v3_pretrain_config" in nemo_argv
    pairs = dict(t.split("=", 1) for t in nemo_argv if t.startswith(("model.", "ddp.", "mixed")))
    assert pairs["model.expert_model_parallel_size"] == "8"
    assert pairs["model.moe_token_dispatcher_type"] == "flex"
    assert pairs["model.moe_flex_dispatcher_backend"] == "hybridep"
    assert pairs["model.pipeline_model_parallel_layout"].endswith("mL")
    assert pairs["ddp.grad_reduce_in_fp32"] == "true"
    for module, message in ((ds, "DeepSpeed cannot express the experts of deepseek-v3"),
                            (torchtitan, "no llama3 flavor")):  # fmt: skip
        with pytest.raises(EmitError, match=message):
            module.emit(run)
    # llmopt's own run config: ep and expert_tp in [parallel], the experts' all-to-all in the
    # planner's table (DeepSeek-V3's first 3 blocks are dense: the first stage's 4 blocks, as
    # in NVIDIA's layout E+4 | 4 x 14 | 1+mtp+loss, hold one MoE block)
    config = run_config(run)
    assert (config["parallel"]["ep"], config["parallel"]["expert_tp"]) == (8, 1)
    comm = config["planner"]["comm"]
    first, last = (comm[k]["ep"]["all_to_all"]["calls"] for k in ("first", "last"))
    assert 0 < first and 0 < last
    # EP folded over tp beyond dp*cp (Megatron-Core's folding) has no ParallelPlan: refused
    import dataclasses

    folded = dataclasses.replace(run, plan=dataclasses.replace(run.plan, expert_parallel=32))
    with pytest.raises(EmitError, match=r"ep=32 is folded beyond dp\*cp=16"):
        run_config(folded)
