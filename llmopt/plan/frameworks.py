"""Framework profiles: what each training framework can run, as vectorised rules over a grid.

One definition serves two callers: the search prunes with these masks (`--framework`), and each
exporter in `llmopt.plan.emit` refuses a plan with the same rule and the same message. Rules
about the plan's numerics (precision, gradient-reduce dtype) are masks too, constant over a
grid. Rules that need more than the plan (a recipe per model preset, the FP8 recipe) stay in
the exporters. Each rule cites the framework source file it restates, at a pinned commit
(`Rule.source`); what a framework accepts is not refused (see the comments on uneven pipeline
splits, Megatron-FSDP with PP and folded EP below).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.grid import REDUCE_DTYPE_OF_STATE, Grid, to_grid
from llmopt.plan.memory import grad_policy
from llmopt.plan.rules import msg_at
from llmopt.plan.workload import Workload

FRAMEWORKS = ("llmopt", "megatron", "nemo", "torchtitan", "deepspeed")
LABELS = {
    "llmopt": "llmopt",
    "megatron": "Megatron-LM",
    "nemo": "Megatron-Bridge",
    "torchtitan": "torchtitan",
    "deepspeed": "DeepSpeed",
}
_SCHED = {"gpipe": 0, "1f1b": 1, "interleaved": 2}


# The gradient-reduce dtype each framework uses unless told otherwise (`--reduce-dtype`):
# Megatron-LM reduces the fp32 main_grad (megatron/training/arguments.py: --grad-reduce-in-bf16
# is off by default); Megatron-Bridge's performance recipes set grad_reduce_in_fp32=False
# (scripts/performance/configs/*/ @b7b4e11b); torchtitan reduces in float32 (job_config.py);
# DeepSpeed reduces in the model dtype (communication_data_type defaults to it).
DEFAULT_REDUCE_DTYPE = {
    "llmopt": "fp32",
    "megatron": "fp32",
    "nemo": "bf16",
    "torchtitan": "fp32",
    "deepspeed": "bf16",
}


# The kernels each framework trains with unless told otherwise (`Workload` fields): PyTorch's
# SDPA runs FlashAttention-2 on Hopper by default (llmopt's engine, torchtitan; DeepSpeed users
# bring FlashAttention-2); Megatron-LM and Megatron-Bridge run Transformer Engine's cuDNN
# attention and fuse FP8 casts into their kernels; torchtitan's "selective" AC is op-level
# (every second matmul recomputed, parallelize_llama.py) and its Float8 is torchao's, with FP8
# weight all-gathers under FSDP (its float8 docs' recommended setting).
FRAMEWORK_KERNELS: dict[str, dict[str, object]] = {
    "llmopt": {"attention_kernel": "fa2"},
    "megatron": {"attention_kernel": "fa3"},
    "nemo": {"attention_kernel": "fa3"},
    "torchtitan": {
        "attention_kernel": "fa2",
        "selective": "every-other-mm",
        "fp8_casts": "torchao",
        "fp8_param_gather": True,
    },
    "deepspeed": {"attention_kernel": "fa2"},
}


def recipe_moments(framework: str, model_name: str) -> str:
    """Adam moment dtype a framework's recipe for the model sets: Megatron-Bridge's DeepSeek-V3
    recipe keeps Adam's moments in bf16 (recipes/deepseek/h100/deepseek_v3.py @b7b4e11b:
    exp_avg_dtype = exp_avg_sq_dtype = bfloat16); fp32 otherwise."""
    return "bf16" if framework == "nemo" and model_name.startswith("deepseek-v3") else "fp32"


def rule_sources(name: str) -> list[tuple[str, str]]:
    """(what the rule refuses, the framework source it restates) for `name`'s rules."""
    return [(r.what, r.source) for r in RULES[check_framework(name)]]


class FrameworkError(LlmoptError, ValueError):
    """An unknown framework name."""


@dataclass(frozen=True)
class Numerics:
    """The plan-independent part a rule may read: GEMM precision, gradient-reduce dtype and the
    overlap switches of the workload."""

    precision: str
    reduce_dtype: str
    tp_comm_overlap: bool = False
    ep_comm_overlap: bool = False

    @classmethod
    def of_work(cls, work: Workload) -> Numerics:
        return cls(
            work.precision,
            REDUCE_DTYPE_OF_STATE[work.state_bytes],
            work.tp_comm_overlap,
            work.ep_comm_overlap,
        )

    @classmethod
    def of_plan(cls, plan: ParallelPlan, work: Workload | None = None) -> Numerics:
        overlap = (work.tp_comm_overlap, work.ep_comm_overlap) if work is not None else (0, 0)
        return cls(plan.precision, plan.reduce_dtype, bool(overlap[0]), bool(overlap[1]))


Mask = Callable[[Grid, ModelConfig, Numerics], np.ndarray]


@dataclass(frozen=True)
class Rule:
    """`label` cannot express `what` (grid placeholders such as {pp}); `fix` says what can;
    `source` is the framework file (at a pinned commit) whose check the rule restates."""

    label: str
    what: str
    fix: str
    mask: Mask
    source: str = ""

    def message(self, model: ModelConfig) -> str:
        what = self.what.replace("{L}", str(model.num_layers))
        return f"{self.label} cannot express {what}; {self.fix}"


def _const(value: bool) -> Callable[[Grid], np.ndarray]:
    return lambda g: np.full(len(g["tp"]), value, dtype=bool)


def _ceil_div(a: np.ndarray | int, b: np.ndarray) -> np.ndarray:
    return -(-a // b)


# Pinned sources. Megatron-LM: NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553;
# Megatron-Bridge: NVIDIA-NeMo/Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a (its
# performance configs @b7b4e11b054e73fa3cfc52e5df14cd6b4d50e02e); torchtitan:
# pytorch/torchtitan@238fa9953e4aec2a62582121564273d7cbb1e9f1; DeepSpeed: the deepspeed==0.19.8
# package (installed as a dev dependency, so its own checks run in tests/plan/test_plan_emit.py).
MEGATRON_LM = "NVIDIA/Megatron-LM@d98e8a64"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge@067f987d"
TITAN = "pytorch/torchtitan@238fa995"
DEEPSPEED = "deepspeed==0.19.8"

# What Megatron-LM does NOT refuse, so the planner does not either (issue 27):
# - uneven pipeline splits: megatron/training/arguments.py (validate_args, "Uneven virtual
#   pipeline parallelism") accepts --pipeline-model-parallel-layout, --decoder-first/last-
#   pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split, and
#   megatron/core/transformer/transformer_config.py (__post_init__, "PP layout"/"Uneven PP")
#   checks only that a layout places every layer; the exporters write the layout.
# - ZeRO-2/3 (Megatron-FSDP, --use-megatron-fsdp) with pp>1: arguments.py refuses pipeline
#   parallelism only for --use-torch-fsdp2 ("--use-torch-fsdp2 is not supported with pipeline
#   parallelism"), not for Megatron-FSDP.
# - EP beyond dp*cp: megatron/core/parallel_state.py (initialize_model_parallel) folds
#   etp x ep x edp over the tp*cp*dp ranks of a stage (`llmopt.plan.experts.expert_reasons`).
_MEGATRON = "Megatron-LM"
MEGATRON_RULES: tuple[Rule, ...] = (
    Rule(_MEGATRON, "schedule=gpipe", "use 1f1b or interleaved",
         lambda g, m, n: (g["pp"] > 1) & (g["sched"] == _SCHED["gpipe"]),
         f"{MEGATRON_LM} megatron/core/pipeline_parallel/schedules.py get_forward_backward_func "
         "(no pipelining, 1F1B, or interleaved 1F1B)"),
    Rule(_MEGATRON,
         "tp_comm_overlap with sequence_parallel=false (TP comm/GEMM overlap needs sequence "
         "parallelism)",
         "use sequence_parallel=true or drop --tp-comm-overlap",
         lambda g, m, n: n.tp_comm_overlap & (g["tp"] > 1) & (g["sp"] == 0),
         f"{MEGATRON_LM} megatron/training/arguments.py validate_args "
         "(args.tp_comm_overlap asserts args.sequence_parallel)"),
    Rule(_MEGATRON,
         "EP A2A overlap with pp={pp} and no virtual stages",
         "use schedule=interleaved (virtual_stages>1) or pp=1",
         lambda g, m, n: n.ep_comm_overlap & (g["pp"] > 1) & (g["v"] == 1),
         f"{MEGATRON_LM} megatron/core/transformer/transformer_config.py __post_init__ "
         "(overlap_moe_expert_parallel_comm: virtual_pipeline_model_parallel_size must be set)"),
    Rule(_MEGATRON,
         "EP A2A overlap with recompute=full",
         "use recompute=selective or none",
         lambda g, m, n: n.ep_comm_overlap & (g["rc"] == 2),
         f"{MEGATRON_LM} megatron/core/transformer/transformer_config.py __post_init__ "
         "(overlap_moe_expert_parallel_comm: disable full recomputation)"),
)  # fmt: skip

# Megatron-Bridge builds Megatron-Core configs, so Megatron-Core's rules hold; its gradient
# reduce dtype is a field (ddp.grad_reduce_in_fp32), which its performance recipes set to False
# (scripts/performance/configs/llama/llama31_llm_pretrain.py @b7b4e11b): bf16 is expressible.
NEMO_RULES: tuple[Rule, ...] = tuple(
    Rule("Megatron-Bridge", r.what, r.fix, r.mask, r.source) for r in MEGATRON_RULES
)

_TITAN = "torchtitan"
TORCHTITAN_RULES: tuple[Rule, ...] = (
    Rule(_TITAN, "zero_stage=1 (FSDP2 always shards parameters)",
         "use zero_stage=2 (reshard never) or 3 (reshard always)",
         lambda g, m, n: g["zero"] == 1,
         f"{TITAN} torchtitan/models/llama3/infra/parallelize.py apply_fsdp (fully_shard)"),
    Rule(_TITAN,
         "zero_stage=0 with tp={tp},pp={pp},dp={dp},cp={cp} (its DDP path is 1-D data "
         "parallelism only; with cp>1 it applies FSDP)",
         "use zero_stage=2 or 3",
         lambda g, m, n: (g["zero"] == 0) & (g["tp"] * g["pp"] * g["cp"] > 1),
         f"{TITAN} torchtitan/models/llama3/infra/parallelize.py:151 "
         "(\"DDP has not supported > 1D parallelism\")"),
    Rule(_TITAN,
         "tp>1 without sequence_parallel (its TP plan always shards norms over the sequence)",
         "use sequence_parallel=true",
         lambda g, m, n: (g["tp"] > 1) & (g["sp"] == 0),
         f"{TITAN} torchtitan/models/llama3/infra/parallelize.py apply_tp (SequenceParallel "
         "norms)"),
    Rule(_TITAN,
         "grad_reduce=microbatch with pp={pp} (torch.distributed.pipelining defers FSDP's "
         "reduce-scatter to the last backward)",
         "use grad_reduce=step",
         lambda g, m, n: (g["pp"] > 1) & (g["zero"] >= 2) & (grad_policy(g) == 0),
         "torch==2.13 torch/distributed/pipelining/stage.py backward_maybe_with_nosync"),
    Rule(_TITAN, "reduce_dtype=bf16", "use reduce_dtype=fp32",
         lambda g, m, n: _const(n.reduce_dtype != "fp32")(g),
         f"{TITAN} torchtitan/config/job_config.py:290 "
         "(mixed_precision_reduce: Literal[\"float32\"])"),
    # Stages come from ceil((L + input_weight + output_weight) / layers_per_stage) with the
    # embedding and the output layer weighted like one layer each by default, so pp*v stages
    # exist when some layers_per_stage gives exactly that count.
    Rule(_TITAN, "num_layers={L} over {pv} pipeline stages",
         "choose pp*virtual_stages so that ceil((layers + 2) / stage size) equals it",
         lambda g, m, n: _ceil_div(m.num_layers + 2, _ceil_div(m.num_layers + 2, g["pp"] * g["v"]))
         != g["pp"] * g["v"],
         f"{TITAN} torchtitan/distributed/pipeline_parallel.py:59-108 "
         "(pipeline_parallel_layers_per_stage, first/last_stage_less_layers)"),
)  # fmt: skip

_DS = "DeepSpeed"
DEEPSPEED_RULES: tuple[Rule, ...] = (
    # deepspeed/runtime/pipe/engine.py: PipelineEngine asserts "ZeRO-2 and ZeRO-3 are
    # incompatible with pipeline parallelism".
    Rule(_DS, "zero_stage={zero} with pp={pp} (its pipeline engine allows ZeRO-0/1)",
         "use zero_stage<=1 or pp=1",
         lambda g, m, n: (g["pp"] > 1) & (g["zero"] >= 2),
         f"{DEEPSPEED} deepspeed/runtime/pipe/engine.py:77 (\"ZeRO-2 and ZeRO-3 are incompatible "
         "with pipeline parallelism\")"),
    # deepspeed/runtime/zero/stage_1_and_2.py (reduce_ready_partitions_and_remove_grads): with
    # partition_gradients (ZeRO-2) gradients are reduced in every micro-batch's backward, not
    # only at the accumulation boundary; stage3.py likewise. Its policy is "microbatch".
    Rule(_DS, "grad_reduce=step (ZeRO-2/3 reduce every micro-batch's gradients)",
         "use grad_reduce=microbatch, or zero_stage=1 to reduce once per step",
         lambda g, m, n: (g["zero"] >= 2) & (grad_policy(g) == 1),
         f"{DEEPSPEED} deepspeed/runtime/zero/stage_1_and_2.py "
         "reduce_ready_partitions_and_remove_grads"),
    # deepspeed/runtime/pipe/schedule.py: TrainSchedule is its only training schedule (1F1B).
    Rule(_DS, "schedule={schedule}", "use schedule=1f1b",
         lambda g, m, n: (g["pp"] > 1) & (g["sched"] != _SCHED["1f1b"]),
         f"{DEEPSPEED} deepspeed/runtime/pipe/schedule.py (TrainSchedule = 1F1B; DualPipeV)"),
    # deepspeed/runtime/pipe/module.py: PipelineModule has no AutoTP path
    # (deepspeed/module_inject/auto_tp.py shards only non-pipeline models).
    Rule(_DS, "AutoTP (tp>1) inside its pipeline engine", "use tp=1 or pp=1",
         lambda g, m, n: (g["pp"] > 1) & (g["tp"] > 1),
         f"{DEEPSPEED} deepspeed/runtime/pipe/module.py PipelineModule"),
    # deepspeed/sequence/layer.py: its sequence parallelism is Ulysses all-to-all, no ring CP.
    Rule(_DS, "cp={cp} (ring context parallelism)", "use cp=1", lambda g, m, n: g["cp"] > 1,
         f"{DEEPSPEED} deepspeed/sequence/layer.py (Ulysses all-to-all)"),
    Rule(_DS, "Megatron-style sequence_parallel", "use sequence_parallel=false",
         lambda g, m, n: g["sp"] == 1, f"{DEEPSPEED} deepspeed/sequence/layer.py"),
    # deepspeed/runtime/config.py: no FP8 training setting (bf16/fp16 sections only).
    Rule(_DS, "precision=fp8 in its config", "use precision=bf16",
         lambda g, m, n: _const(n.precision == "fp8")(g),
         f"{DEEPSPEED} deepspeed/runtime/config.py (bf16/fp16 sections only)"),
    # deepspeed/runtime/activation_checkpointing/checkpointing.py checkpoints whole modules.
    Rule(_DS, "recompute=selective (it checkpoints whole modules)", "use none or full",
         lambda g, m, n: g["rc"] == 1,
         f"{DEEPSPEED} deepspeed/runtime/activation_checkpointing/checkpointing.py"),
)  # fmt: skip

# llmopt/parallel/zero/data_parallel.py: ZeRO-2/3 ignore no_sync(), every micro-batch
# reduce-scatters (as DeepSpeed does). Only its run-config exporter applies this rule: the
# default search ("llmopt") ranks every plan the planner prices, both gradient policies.
ENGINE_RULES: tuple[Rule, ...] = (
    Rule("llmopt's engine", "grad_reduce=step (its ZeRO-2/3 reduce-scatter every micro-batch)",
         "use grad_reduce=microbatch, or zero_stage=1 to reduce once per step",
         lambda g, m, n: (g["zero"] >= 2) & (grad_policy(g) == 1),
         "llmopt/parallel/zero/data_parallel.py"),
    Rule("llmopt's engine",
         "num_layers={L} over pp*virtual_stages={pv} interleaved chunks unevenly (a run config "
         "splits chunks evenly)",
         "choose pp*virtual_stages dividing the layers, or pass layers_per_stage to the training engine",
         lambda g, m, n: ((g["v"] > 1) & (m.num_layers % (g["pp"] * g["v"]) != 0))
         | (m.num_layers < g["pp"] * g["v"]),
         "llmopt/parallel/pipeline/stage.py stage_layout"),
)  # fmt: skip

RULES: dict[str, tuple[Rule, ...]] = {
    "llmopt": (),  # every structurally valid plan the planner prices (ENGINE_RULES: its engine)
    "engine": ENGINE_RULES,
    "megatron": MEGATRON_RULES,
    "nemo": NEMO_RULES,
    "torchtitan": TORCHTITAN_RULES,
    "deepspeed": DEEPSPEED_RULES,
}


def check_framework(name: str) -> str:
    """The framework name, or a one-line error listing the valid ones."""
    if name not in RULES:
        raise FrameworkError(
            f"--framework={name!r} is not valid; choose one of {', '.join(FRAMEWORKS)}"
        )
    return name


def framework_reasons(
    name: str, model: ModelConfig, numerics: Numerics, grid: Grid
) -> list[tuple[str, np.ndarray]]:
    """(message, mask of plans the framework cannot run) for each of its rules."""
    return [
        (r.message(model), np.asarray(r.mask(grid, model, numerics), dtype=bool))
        for r in RULES[check_framework(name)]
    ]


def refusal(
    name: str,
    model: ModelConfig,
    plan: ParallelPlan,
    grad_reduce: str = "microbatch",
    work: Workload | None = None,
) -> str | None:
    """The first rule of `name` that refuses this one plan (its message), else None."""
    grid = to_grid(plan, grad_reduce=grad_reduce if plan.zero_stage >= 2 else "microbatch")
    for msg, mask in framework_reasons(name, model, Numerics.of_plan(plan, work), grid):
        if mask[0]:
            return msg_at(msg, grid, 0)
    return None


def frameworks_running(
    model: ModelConfig, plan: ParallelPlan, grad_reduce: str = "microbatch"
) -> list[str]:
    """The frameworks whose plan-level rules accept `plan` (recipes per model not checked)."""
    return [f for f in FRAMEWORKS if refusal(f, model, plan, grad_reduce) is None]
