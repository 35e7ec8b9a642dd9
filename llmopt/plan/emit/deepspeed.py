"""DeepSpeed: the plan as a DeepSpeed JSON config plus a `deepspeed` launcher line.

Keys are those DeepSpeed's own config classes accept (`deepspeed.runtime.config.DeepSpeedConfig`
and its pydantic sections, deepspeed 0.19.8; the test validates the emitted JSON with them).
Tensor parallelism is AutoTP (`tensor_parallel.autotp_size`); the pipeline degree is the
training script's `PipelineModule(num_stages=pp)`, so the launcher line passes it on. What
DeepSpeed cannot run as planned is refused (rules in `llmopt.plan.frameworks`, shared with the
search):
- ZeRO-2/3 with pipeline parallelism (its PipelineEngine asserts "ZeRO-2 and ZeRO-3 are
  incompatible with pipeline parallelism"); a pipeline schedule other than its 1F1B-style
  TrainSchedule; AutoTP together with the pipeline engine (no AutoTP path in runtime/pipe);
- context parallelism and Megatron-style sequence parallelism (DeepSpeed's sequence
  parallelism is Ulysses all-to-all, a different algorithm);
- FP8 (not a DeepSpeed config setting) and selective recomputation (DeepSpeed checkpoints
  whole modules).
"""

from __future__ import annotations

import json
import shlex

from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun
from llmopt.plan.frameworks import refusal


def check(run: PlannedRun) -> None:
    """Refuse what DeepSpeed cannot run as planned (rules: `llmopt.plan.frameworks`)."""
    if run.model.moe is not None or run.model.mla is not None:  # experts live in model code
        raise EmitError(
            f"DeepSpeed cannot express the experts of {run.model.name} in its config "
            "(deepspeed.moe.layer.MoE is built in the training script); use --emit-format "
            "megatron or nemo"
        )
    why = refusal("deepspeed", run.model, run.parallel, run.plan.grad_reduce, run.work)
    if why:
        raise EmitError(why)


def config(run: PlannedRun) -> dict:
    """The DeepSpeed config dict."""
    check(run)
    p, w = run.parallel, run.work
    cfg: dict = {
        "train_batch_size": w.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.num_microbatches,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": p.precision == "bf16"},
        "communication_data_type": p.reduce_dtype,
        "data_types": {"grad_accum_dtype": p.reduce_dtype},
        "zero_optimization": {"stage": p.zero_stage},
    }
    if p.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": p.tp}
    if p.recompute == "full":
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
        }
    return cfg


def launcher(run: PlannedRun, config_path: str = "ds_config.json") -> str:
    """The launcher line; the script builds PipelineModule(num_stages=pp) when pp > 1."""
    c, p = run.cluster, run.parallel
    cmd = ["deepspeed", "--num_nodes", str(c.nodes), "--num_gpus", str(c.gpus_per_node)]
    cmd += ["train.py", "--deepspeed", "--deepspeed_config", config_path]
    if p.pp > 1:
        cmd += ["--pipeline-parallel-size", str(p.pp)]
    return shlex.join(cmd)


def emit(run: PlannedRun, config_path: str = "ds_config.json") -> Emitted:
    text = json.dumps(config(run), indent=1) + "\n"
    c = run.cluster
    sh = (
        "#!/bin/sh\n"
        f"# DeepSpeed: plan #{run.plan.rank or 1} ({run.parallel.short()}) for {run.model.name} "
        f"on {c.nodes}x{c.gpus_per_node} {c.gpu.name}; train.py is your DeepSpeed script"
        + (
            f" (it builds PipelineModule(num_stages={run.parallel.pp}))"
            if run.parallel.pp > 1
            else ""
        )
        + "\n"
        + launcher(run, config_path)
        + "\n"
    )
    return Emitted(text, {".launch.sh": sh})
