"""`llmopt plan` flags -> the planner's inputs (model, cluster, workload, one ParallelPlan).
Flag names are the trainer's (`--num-layers`, `--zero-stage`, `--num-microbatches`, ...)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.grid import STATE_OF_REDUCE_DTYPE
from llmopt.plan.hardware import Cluster, customize, get_cluster, load_cluster_toml
from llmopt.plan.workload import Workload

DEFAULT_NODES = 8  # `--nodes` when neither the flag nor a cluster file says
# Largest count a shape, cluster or workload flag may take: beyond it numbers stop being a model
# or a cluster (and numpy's int64 arithmetic would overflow).
MAX_COUNT = 2**31 - 1

# flag dest (= ModelConfig field = TrainConfig shape override) given on the command line
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "vocab_size",
)
# Shape fields of a MoE model's experts (`MoEConfig`; the trainer's names too)
MOE_SHAPE_FIELDS = ("num_experts", "expert_ffn_hidden")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Shape fields the user set, by ModelConfig name."""
    out: dict[str, Any] = {
        f: getattr(args, f)
        for f in SHAPE_FIELDS + MOE_SHAPE_FIELDS
        if getattr(args, f, None) is not None
    }
    if getattr(args, "mlp_kind", None):
        out.update(mlp=args.mlp_kind)  # the ModelConfig field behind --mlp-kind
    if getattr(args, "tied", None):
        out["tie_embeddings"] = True
    return out


def build_model(args: argparse.Namespace) -> ModelConfig:
    from llmopt.models.presets import get_preset

    spec = args.model
    if not spec.strip():
        raise UsageError("--model is empty: give a preset name, a config.json or an HF directory")
    path = Path(spec)
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"--model {spec}: the directory holds no config.json")
    if spec.endswith(".json") or path.is_dir():
        from llmopt.models.moe_hf import planner_config_from_hf

        _check_head_counts(path / "config.json" if path.is_dir() else path)
        model = planner_config_from_hf(path, name=path.stem)  # MoE layouts planned as MoE
    else:
        model = get_preset(spec)
    changes = model_overrides(args)
    moe_changes = {f: changes.pop(f) for f in MOE_SHAPE_FIELDS if f in changes}
    for name in SHAPE_FIELDS + MOE_SHAPE_FIELDS:
        value = changes.get(name, moe_changes.get(name))
        if value is not None and not 0 < value <= MAX_COUNT:
            raise UsageError(
                f"--{name.replace('_', '-')}={value} must be a positive integer up to {MAX_COUNT}"
            )
    if moe_changes:
        if model.moe is None:
            given = ", ".join(f"--{f.replace('_', '-')}" for f in moe_changes)
            raise UsageError(f"{given}: --model {spec} has no experts (dense)")
        import dataclasses

        from llmopt.models.moe import MoEConfigError

        try:
            moe = dataclasses.replace(model.moe, **moe_changes)
        except MoEConfigError as exc:
            raise UsageError(str(exc)) from None
        changes["moe"] = moe
    if changes:
        if "hidden_size" in changes or "num_heads" in changes:
            changes.setdefault("head_dim", None)
        model = model.replace(name=f"{model.name} (custom)", **changes)
    if model.num_kv_heads < 1 or model.num_heads % model.num_kv_heads:
        raise UsageError(
            f"--model {spec}: num_kv_heads={model.num_kv_heads} must be a positive divisor of "
            f"num_heads={model.num_heads}"
        )
    return model


def check_counts(args: argparse.Namespace) -> None:
    """Integer flags of plan/estimate/compare: positive and at most MAX_COUNT."""
    for dest in ("nodes", "gpus_per_node", "seq_len", "global_batch", "global_batch_tokens",
                 "top_k", "pick", "tp", "pp", "cp", "dp", "ep", "etp", "micro_batch",
                 "num_microbatches", "virtual_stages", "lora_rank"):  # fmt: skip
        value = getattr(args, dest, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COUNT:
            raise UsageError(
                f"--{dest.replace('_', '-')}={value} is too large (at most {MAX_COUNT})"
            )


def _check_head_counts(config_json: Path) -> None:
    """A config.json whose head counts are given but not positive is refused (a 0 would
    otherwise read as "not given" and default to the query heads)."""
    import json

    try:
        hf = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the config reader reports unreadable files in its own words
    for key in ("num_key_value_heads", "num_attention_heads"):
        value = hf.get(key) if isinstance(hf, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise UsageError(f"{config_json}: {key}={value} must be a positive integer")


def _check_cluster_file_says_nodes(path: Path, nodes: int | None) -> None:
    """A cluster file on the command line must say how big the cluster is (the API's default
    of one node would otherwise be planned without a word)."""
    from llmopt.config_files import read_toml

    data = read_toml(path, "cluster file")
    if not data:
        raise UsageError(
            f'{path} is empty: give at least base = "dgx-h100" (or another preset) and nodes = N'
        )
    if "nodes" not in data and nodes is None:
        raise UsageError(f"{path} sets no nodes: add nodes = N to the file or pass --nodes N")


def build_cluster(args: argparse.Namespace) -> Cluster:
    check_counts(args)
    if args.nodes is not None and args.nodes <= 0:
        raise UsageError(f"--nodes={args.nodes} must be a positive integer")
    if args.cluster.endswith(".toml"):  # its `nodes` stands unless --nodes is given
        cluster = load_cluster_toml(args.cluster, nodes=args.nodes)
        _check_cluster_file_says_nodes(Path(args.cluster), args.nodes)
    else:
        cluster = get_cluster(args.cluster, DEFAULT_NODES if args.nodes is None else args.nodes)
    flags = {  # flag dest -> the cluster field it overrides
        "gpus_per_node": "gpus_per_node",
        "peak_tflops": "gpu.peak_bf16_tflops",
        "fp8_tflops": "gpu.peak_fp8_tflops",
        "hbm_gib": "gpu.hbm_gib",
        "hbm_gbs": "gpu.hbm_bandwidth_gbs",
        "gemm_efficiency": "gpu.gemm_efficiency",
        "nvlink_gbs": "intra_node.bandwidth_gbs",
        "ib_gbs": "inter_node.bandwidth_gbs",
    }
    for dest in flags:  # named by its flag: the profile's own message says peak_bf16_tflops
        value = getattr(args, dest)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{dest.replace('_', '-')}={value} must be a positive number")
    return customize(cluster, **{field: getattr(args, dest) for dest, field in flags.items()})


def build_workload(args: argparse.Namespace, model_name: str = "") -> Workload:
    from llmopt.plan.frameworks import FRAMEWORK_KERNELS, recipe_moments

    batch = args.global_batch
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens <= 0 or args.global_batch_tokens % args.seq_len:
            raise UsageError(
                f"--global-batch-tokens={args.global_batch_tokens} must be a positive multiple "
                f"of --seq-len={args.seq_len}"
            )
        batch = args.global_batch_tokens // args.seq_len
    return Workload(
        seq_len=args.seq_len,
        global_batch=batch,
        precision=args.precision,
        flash_attention=not args.no_flash,
        state_bytes=STATE_OF_REDUCE_DTYPE[reduce_dtype(args)],
        tp_comm_overlap=args.tp_comm_overlap,
        dp_comm_overlap=not args.no_dp_overlap,
        flops_convention=getattr(args, "flops_convention", "causal"),
        expert_imbalance=getattr(args, "expert_imbalance", 1.0),
        ep_dispatcher=getattr(args, "ep_dispatcher", "alltoall"),
        ep_comm_overlap=getattr(args, "ep_overlap", False),
        dualpipe=getattr(args, "dualpipe", False),
        # DeepSpeed's ZeRO-3 fetches parameters from module hooks (timing.SHARDING_OVERLAP)
        sharding="deepspeed" if getattr(args, "framework", "llmopt") == "deepspeed" else "fsdp",
        lora_rank=getattr(args, "lora_rank", 0),
        qlora=getattr(args, "qlora", False),
        moments=getattr(args, "moments", None)
        or recipe_moments(getattr(args, "framework", "llmopt"), model_name),
        # the framework's kernels: attention generation, selective AC, FP8 casts
        **FRAMEWORK_KERNELS.get(getattr(args, "framework", "llmopt"), {}),
    )


def reduce_dtype(args: argparse.Namespace) -> str:
    """--reduce-dtype, else the --framework's default (`frameworks.DEFAULT_REDUCE_DTYPE`)."""
    from llmopt.plan.frameworks import DEFAULT_REDUCE_DTYPE

    given = getattr(args, "reduce_dtype", None)
    return given or DEFAULT_REDUCE_DTYPE.get(getattr(args, "framework", "llmopt"), "fp32")


def inputs(args: argparse.Namespace) -> tuple[ModelConfig, Workload, Cluster]:
    model = build_model(args)
    return model, build_workload(args, model.name), build_cluster(args)


def build_plan(args: argparse.Namespace, work: Workload, cluster: Cluster) -> ParallelPlan:
    """`plan estimate`'s fully specified plan; dp and num_microbatches default to what the
    GPU count and the global batch leave."""
    for flag in ("tp", "pp", "cp", "micro_batch", "virtual_stages", "dp", "num_microbatches", "ep"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')}={value} must be a positive integer")
    inner = args.tp * args.pp * args.cp
    dp = args.dp
    if dp is None:
        if cluster.num_gpus % inner:
            raise UsageError(
                f"tp*pp*cp={inner} does not divide the {cluster.num_gpus} GPUs; pass --dp"
            )
        dp = cluster.num_gpus // inner
    m = args.num_microbatches
    if m is None:
        per = dp * args.micro_batch
        if work.global_batch % per:
            raise UsageError(
                f"global batch {work.global_batch} is not divisible by dp*micro_batch={per}"
            )
        m = work.global_batch // per
    return ParallelPlan(
        tp=args.tp, pp=args.pp, dp=dp, cp=args.cp, ep=getattr(args, "ep", 1) or 1,
        sequence_parallel=bool(args.sequence_parallel),
        zero_stage=args.zero_stage, micro_batch=args.micro_batch, num_microbatches=m,
        schedule=args.schedule, virtual_stages=args.virtual_stages, recompute=args.recompute,
        precision=work.precision, fp8_recipe=args.fp8_recipe, reduce_dtype=reduce_dtype(args),
    )  # fmt: skip


def add_budget_flags(g: argparse._ArgumentGroup, d: Any) -> None:
    """Token budget, price and failure model (`llmopt.plan.budget`, `llmopt.plan.goodput`)."""
    g.add_argument("--tokens", default=d(None), help="token budget to train, e.g. 15T, 300B")
    g.add_argument("--gpu-hour-price", type=float, default=d(None), help="cost per GPU-hour")
    g.add_argument("--gpu-mtbf-hours", type=float, default=d(None), help="per-GPU MTBF")
    g.add_argument("--failures-per-day", type=float, default=d(None), help="whole job")
    g.add_argument("--ckpt-gbs", type=float, default=d(None), help="checkpoint write GB/s")
    g.add_argument("--restart-minutes", type=float, default=d(10.0), help="after a failure")


def budget_inputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The budget/goodput flags, checked (None when none of them is given)."""
    from llmopt.plan.budget import BudgetError, check_price, parse_tokens

    names = ("tokens", "gpu_hour_price", "gpu_mtbf_hours", "failures_per_day", "ckpt_gbs")
    got = {n: getattr(args, n, None) for n in names}
    if all(v is None for v in got.values()):
        return None
    tokens = None if got["tokens"] is None else parse_tokens(got["tokens"])
    price = check_price(got["gpu_hour_price"])
    if price is not None and tokens is None:
        raise BudgetError("--gpu-hour-price needs --tokens (the budget it prices)")
    failures = got["gpu_mtbf_hours"] is not None or got["failures_per_day"] is not None
    if failures and got["ckpt_gbs"] is None:
        raise BudgetError("a failure rate needs --ckpt-gbs (checkpoint write bandwidth, GB/s)")
    return {
        "tokens": tokens,
        "price": price,
        "failures": failures,
        "gpu_mtbf_hours": got["gpu_mtbf_hours"],
        "failures_per_day": got["failures_per_day"],
        "ckpt_gbs": got["ckpt_gbs"],
        "restart_minutes": getattr(args, "restart_minutes", 10.0),
    }


def header(model: ModelConfig, work: Workload, cluster: Cluster) -> dict[str, Any]:
    return {
        "model": model.name,
        "parameters": model.num_parameters(),
        "cluster": {
            "name": cluster.name,
            "gpu": cluster.gpu.name,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
        },
        "workload": {
            "seq_len": work.seq_len,
            "global_batch": work.global_batch,
            "precision": work.precision,
            "state_bytes": work.state_bytes,
        },
    }
