"""Training configuration: one validated dataclass, read from TOML (or JSON) plus overrides.

Precedence: dataclass defaults < config file < command-line flags. Every field is a flag
(`--global-batch 16`, `--sequence-parallel/--no-sequence-parallel`), generated from the
dataclass so the file, the flags and the docs cannot drift apart. The parallel fields carry
`ParallelPlan`'s names (zero_stage, num_microbatches, schedule gpipe|1f1b|interleaved, ...), so
the run config `llmopt plan --emit` writes ([model], [data], [parallel], [planner]) is read as
is: tables are flattened, `[planner]` (informational) is skipped.

Re-derived sizes: a run config's [parallel] fixes num_microbatches for its own batch sizes.
When seq_len, global_batch or micro_batch is overridden on the command line (and
num_microbatches is not), num_microbatches is derived again from the new sizes:
global_batch / (dp * micro_batch).

Over 400 lines: one dataclass whose every field carries its flag, its file key and its check;
moving the checks away from the fields would scatter the one concept the module holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.config_files import ConfigFileError, check_fields, dataclass_schema, read_config
from llmopt.errors import LlmoptError
from llmopt.parallel.plan import FP8_RECIPES, PRECISIONS, RECOMPUTES, SCHEDULES, ParallelPlan

# Old spellings -> ParallelPlan's names (refused with a message naming the new one).
RENAMED = {"zero": "zero_stage", "microbatches": "num_microbatches"}
RENAMED_VALUES = {("schedule", "interleaved-1f1b"): "interleaved"}
SKIPPED_TABLES = ("planner",)  # informational in a run config; the trainer ignores it
RESIZING = ("seq_len", "global_batch", "micro_batch")  # overrides that re-derive num_microbatches


# the help of each TrainConfig field's flag (llmopt train; llmopt distill shares the names)
FIELD_HELP = {
    "model": "preset whose shape a randomly initialised model takes (see llmopt plan)",
    "init_from": "start from these weights: packaged name, .gguf, HF directory or checkpoint",
    "num_layers": "override the preset's layer count",
    "hidden_size": "override the preset's hidden size",
    "intermediate_size": "override the preset's MLP width",
    "num_heads": "override the preset's attention heads",
    "num_kv_heads": "override the preset's KV heads (GQA)",
    "tokenizer": "tokenizer to read text with (default: the model's own)",
    "corpus": "pretraining text: corpus:NAME, a text file, or random (synthetic tokens)",
    "data": "fine-tuning data instead of --corpus: FILE.jsonl|.json|.txt, a directory, hf:NAME",
    "format": "fine-tuning record format: text, prompt_completion, messages or auto",
    "packing": "concatenate fine-tuning examples into full rows",
    "eval_fraction": "held-out share of the --data examples",
    "eval_every": "held-out loss every N steps (0: before the first and after the last)",
    "max_chars": "read at most this many characters of text",
    "seq_len": "tokens per sequence",
    "global_batch": "sequences per optimizer step, all data-parallel ranks together",
    "micro_batch": "sequences per forward/backward on one data-parallel rank",
    "steps": "optimizer steps the run ends at",
    "lr": "peak learning rate (after warmup, cosine decay to --min-lr)",
    "min_lr": "learning rate at the last step",
    "warmup_steps": "steps of linear warmup",
    "weight_decay": "AdamW weight decay",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "eps": "AdamW epsilon",
    "clip": "gradient-norm clipping threshold (0: off)",
    "seed": "seed of the initialisation and the data order",
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "dp": "data-parallel degree (-1: the rest of the world)",
    "cp": "context-parallel degree (reserved: 1)",
    "ep": "expert-parallel degree (reserved: 1)",
    "sequence_parallel": "shard activations along the sequence between TP regions",
    "zero_stage": "ZeRO stage 0-3 (optimizer, gradient, parameter sharding over DP)",
    "recompute": "activation recomputation: none, selective or full",
    "schedule": "pipeline schedule: gpipe, 1f1b or interleaved",
    "virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
    "num_microbatches": "microbatches per step (default: global_batch / (dp x micro_batch))",
    "precision": "compute precision: fp32, bf16 or fp8 (a recipe, not a --dtype)",
    "fp8_recipe": "FP8 scaling recipe: current or delayed",
    "reduce_dtype": "gradient-reduction dtype: fp32 or bf16",
    "lora_rank": "LoRA rank (0: train every weight)",
    "lora_alpha": "LoRA alpha (the update is scaled by alpha / rank)",
    "lora_dropout": "dropout on the LoRA input",
    "lora_targets": "linears LoRA wraps: all, attention, feed_forward or a comma list",
    "qlora": "freeze the base linears in INT4 (QLoRA)",
    "save_format": "checkpoint contents: resume, hf, both or all",
    "report_to": "also log to: tensorboard, wandb, mlflow (comma-separated)",
    "out_dir": "run directory (checkpoints, log, loss plot)",
    "log_every": "progress line every N steps",
    "save_every": "checkpoint every N steps (0: only at the end)",
    "keep_checkpoints": "checkpoints kept (older ones are rotated out)",
    "resume": "continue the run in --out-dir from its latest checkpoint",
    "overwrite": "start afresh in an --out-dir holding a run (other files are kept)",
    "skip_nonfinite_steps": "steps with a NaN/inf loss or gradient skipped before stopping",
    "timeout_s": "seconds a collective may wait before the run fails naming the rank",
    "peak_tflops": "per-device peak for MFU (default: a measured dense matmul)",
    "progress": "show a progress bar",
}


class TrainConfigError(LlmoptError, ValueError):
    """A training configuration that cannot run."""


@dataclass
class TrainConfig:
    # model
    model: str = "smollm2-135m"  # a preset name (random init) ...
    init_from: str | None = None  # ... or weights: packaged name, .gguf, HF dir, checkpoint dir
    num_layers: int | None = None  # shape overrides of the preset (small runs on CPU)
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    # data
    tokenizer: str | None = None  # None: the model's own (init_from, else the preset's)
    corpus: str = "corpus:web-bible"  # corpus:NAME, a text file, or random (synthetic tokens)
    data: str | None = None  # fine-tuning data (replaces corpus): FILE.jsonl|.json|.txt|DIR|hf:NAME
    format: str = "auto"  # text | prompt_completion | messages | auto (from each record's keys)
    packing: bool = False  # concatenate examples into rows (no cross-document attention mask)
    eval_fraction: float = 0.1  # held-out share of --data examples
    eval_every: int = 0  # eval loss every N steps (0: before the first and after the last step)
    max_chars: int | None = None
    seq_len: int = 128
    global_batch: int = 8  # sequences per optimizer step, all DP ranks together
    micro_batch: int = 2  # sequences per forward/backward on one DP rank
    # optimisation
    steps: int = 100
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0
    # parallelism
    tp: int = 1
    pp: int = 1
    dp: int = -1  # -1: the rest of the world
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    num_microbatches: int | None = None  # None: global_batch / (dp * micro_batch)
    # precision
    precision: str = "fp32"
    fp8_recipe: str = "current"
    reduce_dtype: str = "fp32"
    # fine-tuning: LoRA / QLoRA adapters (llmopt.train.lora)
    lora_rank: int = 0  # 0: train every weight
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all"  # all | attention | feed_forward | comma-separated linear names
    qlora: bool = False  # frozen base linears in INT4 (RTN, group 64)
    # bookkeeping
    save_format: str = "all"  # resume (rank shards) | hf | both (shards + hf) | all (+ full/)
    report_to: str = ""  # comma-separated: tensorboard, wandb, mlflow
    out_dir: str = "runs/train"
    log_every: int = 1
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False  # start afresh in a used out_dir (its checkpoints and log deleted)
    skip_nonfinite_steps: int = 0  # steps with a NaN/inf loss or grad norm skipped before stopping
    timeout_s: float = 120.0
    peak_tflops: float | None = None  # per device; None: measured dense-matmul peak
    progress: bool = True

    def __post_init__(self) -> None:
        for (name, old), new in RENAMED_VALUES.items():
            if getattr(self, name) == old:
                raise TrainConfigError(f"{name}={old!r} is now called {name}={new!r}")
        positive = ("seq_len", "global_batch", "micro_batch", "tp", "pp", "virtual_stages")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainConfigError(f"{name}={value!r} must be a positive integer")
        if self.steps < 0:
            raise TrainConfigError(f"steps={self.steps} must be >= 0")
        if self.dp != -1 and self.dp < 1:
            raise TrainConfigError(f"dp={self.dp} must be positive (or -1: the rest of the world)")
        for name in ("cp", "ep"):
            if getattr(self, name) != 1:
                raise TrainConfigError(
                    f"{name}={getattr(self, name)!r}: the trainer runs {name}=1 only"
                )
        if self.num_microbatches is not None and (
            not isinstance(self.num_microbatches, int) or self.num_microbatches < 1
        ):
            raise TrainConfigError(
                f"num_microbatches={self.num_microbatches!r} must be a positive integer"
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise TrainConfigError(
                f"zero_stage={self.zero_stage!r} is not a ZeRO stage; choose 0, 1, 2 or 3"
            )
        if self.recompute not in RECOMPUTES:
            raise TrainConfigError(
                f"recompute={self.recompute!r} is not valid; choose one of {RECOMPUTES}"
            )
        if self.precision not in PRECISIONS:
            raise TrainConfigError(
                f"precision={self.precision!r} is not valid; choose one of {PRECISIONS}"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise TrainConfigError(
                f"fp8_recipe={self.fp8_recipe!r} is not valid; choose one of {FP8_RECIPES}"
            )
        if self.precision == "fp8" and self.pp > 1:
            raise TrainConfigError(
                "precision=fp8 with pp>1 is not supported yet: amaxes must be reduced over the "
                "ranks holding the same stage (tp x dp), a group the grid does not create; "
                "use pp=1 or precision=bf16"
            )
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise TrainConfigError(f"reduce_dtype={self.reduce_dtype!r}: choose 'fp32' or 'bf16'")
        if self.schedule not in SCHEDULES:
            raise TrainConfigError(
                f"schedule={self.schedule!r} is not valid; choose one of {SCHEDULES}"
            )
        for name in ("lr", "min_lr", "clip", "weight_decay", "eps", "beta1", "beta2"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value):
                raise TrainConfigError(f"{name}={value!r} must be a finite number")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise TrainConfigError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}), lr > 0")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Optimiser and bookkeeping values in range, before any process starts or loads."""
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise TrainConfigError(f"{name}={getattr(self, name)!r} must be in [0, 1)")
        if self.eps <= 0:
            raise TrainConfigError(f"eps={self.eps!r} must be > 0")
        if self.weight_decay < 0:
            raise TrainConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if self.clip < 0:
            raise TrainConfigError(
                f"clip={self.clip!r} must be >= 0 (the gradient-norm bound; 0: no clipping)"
            )
        for name in ("warmup_steps", "log_every", "save_every", "keep_checkpoints", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TrainConfigError(f"{name}={value!r} must be an integer")
        if self.warmup_steps < 0:
            raise TrainConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.log_every < 1 or self.save_every < 0 or self.keep_checkpoints < 1:
            raise TrainConfigError(
                f"log_every={self.log_every} and keep_checkpoints={self.keep_checkpoints} must "
                f"be >= 1, save_every={self.save_every} >= 0"
            )
        for name, value, low in (
            ("timeout_s", self.timeout_s, "> 0"),
            ("peak_tflops", self.peak_tflops, "> 0 (or unset: measured)"),
        ):
            if value is None and name == "peak_tflops":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0:
                raise TrainConfigError(f"{name}={value!r} must be a finite number {low}")
        if self.max_chars is not None and (
            not isinstance(self.max_chars, int)
            or isinstance(self.max_chars, bool)
            or self.max_chars < 1
        ):
            raise TrainConfigError(f"max_chars={self.max_chars!r} must be a positive integer")
        skips = self.skip_nonfinite_steps
        if not isinstance(skips, int) or isinstance(skips, bool) or skips < 0:
            raise TrainConfigError(f"skip_nonfinite_steps={skips!r} must be an integer >= 0")
        if self.resume and self.overwrite:
            raise TrainConfigError(
                "resume and overwrite contradict each other: resume continues the run in "
                "out_dir, overwrite deletes it; give one"
            )
        from llmopt.train.finetune_config import validate_finetune

        validate_finetune(self, TrainConfigError)

    # ---- derived ----
    def micro_steps(self, dp: int) -> int:
        """Gradient-accumulation steps per optimizer step for a DP degree."""
        per_rank, rem = divmod(self.global_batch, dp)
        if rem:
            raise TrainConfigError(f"global_batch={self.global_batch} is not divisible by dp={dp}")
        n, rem = divmod(per_rank, self.micro_batch)
        if rem:
            raise TrainConfigError(
                f"global_batch/dp={per_rank} is not divisible by micro_batch={self.micro_batch}"
            )
        return n

    def resolve_dp(self, world_size: int) -> int:
        """The DP degree on `world_size` ranks (dp=-1: what tp*pp leave)."""
        other = self.tp * self.pp * self.cp
        if self.dp == -1:
            if world_size % other:
                raise TrainConfigError(
                    f"tp*pp*cp={other} (tp={self.tp}, pp={self.pp}) does not divide the "
                    f"world of {world_size} ranks"
                )
            return world_size // other
        if other * self.dp != world_size:
            raise TrainConfigError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {other * self.dp} does not equal "
                f"the world of {world_size} ranks"
            )
        return self.dp

    def parallel_plan(self, world_size: int) -> ParallelPlan:
        """The ParallelPlan this config runs on `world_size` ranks (dp resolved, and
        num_microbatches derived from or checked against global_batch / (dp * micro_batch))."""
        dp = self.resolve_dp(world_size)
        derived = self.micro_steps(dp)
        if self.num_microbatches is not None and self.num_microbatches != derived:
            raise TrainConfigError(
                f"num_microbatches={self.num_microbatches} does not match global_batch "
                f"{self.global_batch} / (dp {dp} x micro_batch {self.micro_batch}) = {derived}; "
                "drop num_microbatches to derive it, or change the batch sizes"
            )
        return ParallelPlan(
            tp=self.tp,
            pp=self.pp,
            dp=dp,
            cp=self.cp,
            ep=self.ep,
            sequence_parallel=self.sequence_parallel,
            zero_stage=self.zero_stage,
            micro_batch=self.micro_batch,
            num_microbatches=derived,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            recompute=self.recompute,
            precision=self.precision,
            fp8_recipe=self.fp8_recipe,
            reduce_dtype=self.reduce_dtype,
        )

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        flat: dict[str, Any] = {}
        for key, value in data.items():
            # TOML tables ([model], [data], [parallel]...) are only grouping: flatten them.
            if isinstance(value, dict):
                if key not in SKIPPED_TABLES:
                    flat.update(value)
            else:
                flat[key] = value
        flat = {k.replace("-", "_"): v for k, v in flat.items()}
        for old, new in RENAMED.items():
            if old in flat:
                raise TrainConfigError(f"training config key {old!r} is now called {new!r}")
        unknown = set(flat) - known
        if unknown:
            raise TrainConfigError(
                f"unknown training config keys {sorted(unknown)}; valid keys: {sorted(known)}"
            )
        check_fields("training config", flat, dataclass_schema(cls), error=TrainConfigError)
        return cls(**flat)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        try:
            return cls.from_dict(read_config(path, "training config"))
        except ConfigFileError as exc:
            raise TrainConfigError(str(exc)) from None
        except TrainConfigError as exc:  # name the file the bad value came from
            raise TrainConfigError(
                f"{path}: {str(exc).removeprefix('training config: ')}"
            ) from None

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# ---- command-line flags generated from the dataclass ----
def _flag_type(hint: Any):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return base


class _Renamed(argparse.Action):
    """An old flag: refuse it, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.metavar}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` plus one flag per TrainConfig field (default: not given)."""
    parser.add_argument("--config", help="TOML (or JSON) training config; flags override it")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base = _flag_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = FIELD_HELP[f.name] + (f" (default: {default})" if default is not None else "")
        if base is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=base, default=None, help=help_text)
    for old, new in RENAMED.items():
        parser.add_argument(
            "--" + old,
            action=_Renamed,
            metavar="--" + new.replace("_", "-"),
            dest="renamed_" + old,
            help=argparse.SUPPRESS,
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config file < flags; a size flag re-derives num_microbatches (module doc)."""
    base = TrainConfig.from_file(args.config) if getattr(args, "config", None) else TrainConfig()
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    resized = any(name in changes for name in RESIZING)
    if resized and "num_microbatches" not in changes:
        changes["num_microbatches"] = None
    return base.replace(**changes)
