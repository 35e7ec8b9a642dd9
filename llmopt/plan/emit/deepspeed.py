"""DeepSpeed: the plan as a DeepSpeed JSON config plus a `deepspeed` launcher line.

Keys are those DeepSpeed's own config classes accept (`deepspeed.runtime.config.DeepSpeedConfig`
and its pydantic sections, deepspeed 0.19.8; the test validates the emitted JSON with them).
Tensor parallelism is AutoTP (`tensor_parallel.autotp_size`); the pipeline degree is the
training script's `PipelineModule(num_stages=pp)`, so the launcher line passes it on. What
DeepSpeed cannot run as planned is refused:
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

from llmopt.plan.emit.base import Emitted, PlannedRun, refuse

FRAMEWORK = "DeepSpeed"


def check(run: PlannedRun) -> None:
    p = run.parallel
    if p.pp > 1 and p.zero_stage >= 2:
        raise refuse(
            FRAMEWORK,
            f"zero_stage={p.zero_stage} with pp={p.pp} (its pipeline engine allows ZeRO-0/1)",
            "use zero_stage<=1 or pp=1",
        )
    if p.pp > 1 and p.schedule != "1f1b":
        raise refuse(FRAMEWORK, f"schedule={p.schedule}", "use schedule=1f1b")
    if p.pp > 1 and p.tp > 1:
        raise refuse(FRAMEWORK, "AutoTP (tp>1) inside its pipeline engine", "use tp=1 or pp=1")
    if p.cp > 1:
        raise refuse(FRAMEWORK, f"cp={p.cp} (ring context parallelism)", "use cp=1")
    if p.sequence_parallel:
        raise refuse(FRAMEWORK, "Megatron-style sequence_parallel", "use sequence_parallel=false")
    if p.precision == "fp8":
        raise refuse(FRAMEWORK, "precision=fp8 in its config", "use precision=bf16")
    if p.recompute == "selective":
        raise refuse(
            FRAMEWORK, "recompute=selective (it checkpoints whole modules)", "use none or full"
        )


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
