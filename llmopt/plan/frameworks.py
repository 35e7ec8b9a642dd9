"""Framework profiles: what each training framework can run, as vectorised rules over a grid.

One definition serves two callers: the search prunes with these masks (`--framework`), and each
exporter in `llmopt.plan.emit` refuses a plan with the same rule and the same message. Rules
about the plan's numerics (precision, gradient-reduce dtype) are masks too, constant over a
grid. Rules that need more than the plan (a recipe per model preset, the FP8 recipe) stay in
the exporters. Each rule cites the framework source file it comes from.
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


class FrameworkError(LlmoptError, ValueError):
    """An unknown framework name."""


@dataclass(frozen=True)
class Numerics:
    """The plan-independent part a rule may read: GEMM precision and gradient-reduce dtype."""

    precision: str
    reduce_dtype: str

    @classmethod
    def of_work(cls, work: Workload) -> Numerics:
        return cls(work.precision, REDUCE_DTYPE_OF_STATE[work.state_bytes])

    @classmethod
    def of_plan(cls, plan: ParallelPlan) -> Numerics:
        return cls(plan.precision, plan.reduce_dtype)


Mask = Callable[[Grid, ModelConfig, Numerics], np.ndarray]


@dataclass(frozen=True)
class Rule:
    """`label` cannot express `what` (grid placeholders such as {pp}); `fix` says what can."""

    label: str
    what: str
    fix: str
    mask: Mask

    def message(self, model: ModelConfig) -> str:
        what = self.what.replace("{L}", str(model.num_layers))
        return f"{self.label} cannot express {what}; {self.fix}"


def _const(value: bool) -> Callable[[Grid], np.ndarray]:
    return lambda g: np.full(len(g["tp"]), value, dtype=bool)


def _ceil_div(a: np.ndarray | int, b: np.ndarray) -> np.ndarray:
    return -(-a // b)


_MEGATRON = "Megatron-LM"
MEGATRON_RULES: tuple[Rule, ...] = (
    # megatron/core/pipeline_parallel/schedules.py: forward_backward_pipelining_without_
    # interleaving (1F1B) and _with_interleaving are the only pipeline schedules.
    Rule(_MEGATRON, "schedule=gpipe", "use 1f1b or interleaved",
         lambda g, m, n: (g["pp"] > 1) & (g["sched"] == _SCHED["gpipe"])),
    # megatron/training/arguments.py (validate_args): num_layers must be divisible by
    # pipeline_model_parallel_size (and by the virtual stages when interleaving).
    Rule(_MEGATRON,
         "num_layers={L} split over pp*virtual_stages={pv} unevenly (its parser asserts "
         "divisibility)",
         "choose pp and virtual_stages that divide the layers",
         lambda g, m, n: m.num_layers % (g["pp"] * g["v"]) != 0),
    # ZeRO-2/3 are Megatron-FSDP (megatron/core/distributed/fsdp, --use-megatron-fsdp), which
    # Megatron's standard path does not combine with pipeline parallelism
    # (examples/multimodal_dev/scripts/run_qwen35_vl.sh, NVIDIA/Megatron-LM PR #6081: "FSDP and
    # PP are mutually exclusive"); with pp>1 it offers only its distributed optimizer
    # (megatron/core/optimizer/distrib_optimizer.py) = ZeRO-1.
    Rule(_MEGATRON,
         "zero_stage={zero} with pp={pp} (with pipeline parallelism it offers only the "
         "distributed optimizer, ZeRO-1)",
         "use zero_stage<=1 or pp=1",
         lambda g, m, n: (g["pp"] > 1) & (g["zero"] >= 2)),
)  # fmt: skip

_BRIDGE = "Megatron-Bridge"
NEMO_RULES: tuple[Rule, ...] = MEGATRON_RULES + (
    # src/megatron/bridge/training/mixed_precision.py: the bf16/fp8 presets set
    # grad_reduce_in_fp32=True.
    Rule(_BRIDGE,
         "reduce_dtype=bf16 through a recipe override (its mixed-precision presets set "
         "grad_reduce_in_fp32)",
         "use reduce_dtype=fp32",
         lambda g, m, n: _const(n.reduce_dtype != "fp32")(g)),
)  # fmt: skip

_TITAN = "torchtitan"
TORCHTITAN_RULES: tuple[Rule, ...] = (
    # torchtitan/models/llama3/infra/parallelize.py: data parallelism is FSDP2 fully_shard
    # (parameters always sharded) or DDP; nothing shards only optimizer states.
    Rule(_TITAN, "zero_stage=1 (FSDP2 always shards parameters)",
         "use zero_stage=2 (reshard never) or 3 (reshard always)",
         lambda g, m, n: g["zero"] == 1),
    # torchtitan/models/llama3/infra/parallelize.py: apply_ddp raises "DDP has not supported
    # > 1D parallelism"; with cp>1 FSDP is applied over the cp ranks.
    Rule(_TITAN,
         "zero_stage=0 with tp={tp},pp={pp},dp={dp},cp={cp} (its DDP path is 1-D data "
         "parallelism only; with cp>1 it applies FSDP)",
         "use zero_stage=2 or 3",
         lambda g, m, n: (g["zero"] == 0) & (g["tp"] * g["pp"] * g["cp"] > 1)),
    # torchtitan/models/llama3/infra/parallelize.py: apply_tp's plan shards norms over the
    # sequence (SequenceParallel) whenever tp>1.
    Rule(_TITAN,
         "tp>1 without sequence_parallel (its TP plan always shards norms over the sequence)",
         "use sequence_parallel=true",
         lambda g, m, n: (g["tp"] > 1) & (g["sp"] == 0)),
    # torch/distributed/pipelining/stage.py (backward_maybe_with_nosync): with pp>1 every
    # backward but the last runs with set_requires_gradient_sync(False), and the REDUCE_GRAD
    # action reduce-scatters once per step: its ZeRO-2/3 gradient policy is "step".
    Rule(_TITAN,
         "grad_reduce=microbatch with pp={pp} (torch.distributed.pipelining defers FSDP's "
         "reduce-scatter to the last backward)",
         "use grad_reduce=step",
         lambda g, m, n: (g["pp"] > 1) & (g["zero"] >= 2) & (grad_policy(g) == 0)),
    # torchtitan/config/job_config.py: mixed_precision_reduce accepts only "float32".
    Rule(_TITAN, "reduce_dtype=bf16", "use reduce_dtype=fp32",
         lambda g, m, n: _const(n.reduce_dtype != "fp32")(g)),
    # torchtitan/distributed/pipeline_parallel.py: stages hold ceil(L / stages) layers each
    # (pipeline_parallel_layers_per_stage), so that split must give exactly pp*v stages.
    Rule(_TITAN, "num_layers={L} over {pv} pipeline stages",
         "choose pp*virtual_stages so that ceil(layers / stage size) equals it",
         lambda g, m, n: _ceil_div(m.num_layers, _ceil_div(m.num_layers, g["pp"] * g["v"]))
         != g["pp"] * g["v"]),
)  # fmt: skip

_DS = "DeepSpeed"
DEEPSPEED_RULES: tuple[Rule, ...] = (
    # deepspeed/runtime/pipe/engine.py: PipelineEngine asserts "ZeRO-2 and ZeRO-3 are
    # incompatible with pipeline parallelism".
    Rule(_DS, "zero_stage={zero} with pp={pp} (its pipeline engine allows ZeRO-0/1)",
         "use zero_stage<=1 or pp=1",
         lambda g, m, n: (g["pp"] > 1) & (g["zero"] >= 2)),
    # deepspeed/runtime/zero/stage_1_and_2.py (reduce_ready_partitions_and_remove_grads): with
    # partition_gradients (ZeRO-2) gradients are reduced in every micro-batch's backward, not
    # only at the accumulation boundary; stage3.py likewise. Its policy is "microbatch".
    Rule(_DS, "grad_reduce=step (ZeRO-2/3 reduce every micro-batch's gradients)",
         "use grad_reduce=microbatch, or zero_stage=1 to reduce once per step",
         lambda g, m, n: (g["zero"] >= 2) & (grad_policy(g) == 1)),
    # deepspeed/runtime/pipe/schedule.py: TrainSchedule is its only training schedule (1F1B).
    Rule(_DS, "schedule={schedule}", "use schedule=1f1b",
         lambda g, m, n: (g["pp"] > 1) & (g["sched"] != _SCHED["1f1b"])),
    # deepspeed/runtime/pipe/module.py: PipelineModule has no AutoTP path
    # (deepspeed/module_inject/auto_tp.py shards only non-pipeline models).
    Rule(_DS, "AutoTP (tp>1) inside its pipeline engine", "use tp=1 or pp=1",
         lambda g, m, n: (g["pp"] > 1) & (g["tp"] > 1)),
    # deepspeed/sequence/layer.py: its sequence parallelism is Ulysses all-to-all, no ring CP.
    Rule(_DS, "cp={cp} (ring context parallelism)", "use cp=1", lambda g, m, n: g["cp"] > 1),
    Rule(_DS, "Megatron-style sequence_parallel", "use sequence_parallel=false",
         lambda g, m, n: g["sp"] == 1),
    # deepspeed/runtime/config.py: no FP8 training setting (bf16/fp16 sections only).
    Rule(_DS, "precision=fp8 in its config", "use precision=bf16",
         lambda g, m, n: _const(n.precision == "fp8")(g)),
    # deepspeed/runtime/activation_checkpointing/checkpointing.py checkpoints whole modules.
    Rule(_DS, "recompute=selective (it checkpoints whole modules)", "use none or full",
         lambda g, m, n: g["rc"] == 1),
)  # fmt: skip

# llmopt/parallel/data_parallel.py: ZeRO-2/3 ignore no_sync(), every micro-batch
# reduce-scatters (as DeepSpeed does). Only its run-config exporter applies this rule: the
# default search ("llmopt") ranks every plan the planner prices, both gradient policies.
ENGINE_RULES: tuple[Rule, ...] = (
    Rule("llmopt's engine", "grad_reduce=step (its ZeRO-2/3 reduce-scatter every micro-batch)",
         "use grad_reduce=microbatch, or zero_stage=1 to reduce once per step",
         lambda g, m, n: (g["zero"] >= 2) & (grad_policy(g) == 1)),
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
    name: str, model: ModelConfig, plan: ParallelPlan, grad_reduce: str = "microbatch"
) -> str | None:
    """The first rule of `name` that refuses this one plan (its message), else None."""
    grid = to_grid(plan, grad_reduce=grad_reduce if plan.zero_stage >= 2 else "microbatch")
    for msg, mask in framework_reasons(name, model, Numerics.of_plan(plan), grid):
        if mask[0]:
            return msg_at(msg, grid, 0)
    return None


def frameworks_running(
    model: ModelConfig, plan: ParallelPlan, grad_reduce: str = "microbatch"
) -> list[str]:
    """The frameworks whose plan-level rules accept `plan` (recipes per model not checked)."""
    return [f for f in FRAMEWORKS if refusal(f, model, plan, grad_reduce) is None]
