"""Training configuration: one validated dataclass, read from TOML (or JSON) plus overrides.

Precedence: dataclass defaults < config file < command-line flags. Every key is a flag
(`--global-batch 16`, `--sequence-parallel/--no-sequence-parallel`), generated from the
dataclass so the file, the flags and the docs cannot drift apart. The config holds its layout
as a `ParallelPlan` (`cfg.parallel`), whose field names are the keys (zero_stage,
num_microbatches, schedule gpipe|1f1b|interleaved, ...), so the run config `llmopt plan --emit`
writes ([model], [data], [parallel], [planner]) is read as is: tables are flattened,
`[planner]` (informational) is skipped, and `to_dict` writes the same flat keys back.

Re-derived sizes: a run config's [parallel] fixes num_microbatches for its own batch sizes.
When seq_len, global_batch or micro_batch is overridden on the command line (and
num_microbatches is not), num_microbatches is derived again from the new sizes:
global_batch / (dp * micro_batch).

The flags themselves are generated in `llmopt.train.flags`, their help in
`llmopt.train.field_help`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.config_files import (
    LIST,
    NONE,
    ConfigFileError,
    check_fields,
    dataclass_schema,
    read_config,
)
from llmopt.errors import LlmoptError
from llmopt.parallel.plan import ParallelPlan, PlanError
from llmopt.train.field_help import FIELD_HELP  # noqa: F401 (llmopt distill reads it here)

# Old spellings -> ParallelPlan's names (refused with a message naming the new one).
RENAMED = {"zero": "zero_stage", "microbatches": "num_microbatches"}
RENAMED_VALUES = {("schedule", "interleaved-1f1b"): "interleaved"}
SKIPPED_TABLES = ("planner",)  # informational in a run config; the trainer ignores it
RESIZING = ("seq_len", "global_batch", "micro_batch")  # overrides that re-derive num_microbatches
# the trainer's own requests, resolved into the plan's fields of the same names
REQUESTS = ("dp", "micro_batch", "num_microbatches")
# the plan's fields a training config sets directly (flags, file keys)
LAYOUT_FIELDS = tuple(n for n in ParallelPlan.field_names() if n not in REQUESTS)
DEFAULT_LAYOUT = ParallelPlan(precision="fp32")  # the trainer's default precision is fp32


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
    vocab_size: int | None = None
    # mixture of experts (a MoE preset or --init-from model; llmopt.models.moe.MoEConfig)
    num_experts: int | None = None  # shape overrides of a MoE preset
    expert_ffn_hidden: int | None = None
    moe_top_k: int | None = None  # experts per token
    moe_aux_loss_coef: float | None = None  # Switch load-balancing loss weight
    moe_z_loss_coef: float | None = None  # router z-loss weight
    moe_capacity_factor: float | None = None  # None: dropless
    moe_bias_update_rate: float | None = None  # aux-loss-free balancing (expert_bias models)
    moe_force_balance: bool | None = None  # round-robin routing (benchmarks)
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
    # parallelism: the layout is a `ParallelPlan` (flags and file keys carry its field names:
    # --tp, --zero-stage, [parallel] tp = 2). dp and num_microbatches are requests the world
    # and the batch resolve (`parallel_plan`): until then `parallel.dp` is the requested dp,
    # or with dp=-1 the least dp that lays out the experts, and `parallel.num_microbatches` 1.
    dp: int = -1  # -1: the rest of the world
    num_microbatches: int | None = None  # None: global_batch / (dp * micro_batch)
    parallel: ParallelPlan = field(default_factory=lambda: DEFAULT_LAYOUT)
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
        for name in ("seq_len", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainConfigError(f"{name}={value!r} must be a positive integer")
        if self.steps < 0:
            raise TrainConfigError(f"steps={self.steps} must be >= 0")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int):
            raise TrainConfigError(f"dp={self.dp!r} must be a positive integer")
        if self.dp != -1 and self.dp < 1:
            raise TrainConfigError(f"dp={self.dp} must be positive (or -1: the rest of the world)")
        if self.num_microbatches is not None and (
            not isinstance(self.num_microbatches, int)
            or isinstance(self.num_microbatches, bool)
            or self.num_microbatches < 1
        ):
            raise TrainConfigError(
                f"num_microbatches={self.num_microbatches!r} must be a positive integer"
            )
        if not isinstance(self.parallel, ParallelPlan):
            raise TrainConfigError(
                f"parallel must be a ParallelPlan, got {type(self.parallel).__name__}"
            )
        self.parallel = _layout(self.parallel, self.dp, self.micro_batch, self.num_microbatches)
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
        tp, pp = self.parallel.tp, self.parallel.pp
        other = tp * pp * self.parallel.cp
        if self.dp == -1:
            if world_size % other:
                raise TrainConfigError(
                    f"tp*pp*cp={other} (tp={tp}, pp={pp}) does not divide the "
                    f"world of {world_size} ranks"
                )
            return world_size // other
        if other * self.dp != world_size:
            raise TrainConfigError(
                f"tp*pp*dp = {tp}*{pp}*{self.dp} = {other * self.dp} does not equal "
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
        try:
            return self.parallel.replace(dp=dp, num_microbatches=derived)
        except PlanError as exc:
            raise TrainConfigError(str(exc)) from None

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        """The flat form config files and flags use (the plan's fields beside the rest)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        layout = self.parallel.to_dict()
        del out["parallel"]
        return {**out, **{name: layout[name] for name in LAYOUT_FIELDS}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A config from its flat keys (TOML tables such as [parallel] are only grouping)."""
        known = set(file_keys())
        flat: dict[str, Any] = {}
        for key, value in data.items():
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
        check_fields("training config", flat, _SCHEMA, error=TrainConfigError)
        return cls().replace(**flat)

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
        """A copy with `changes`, which may name the plan's fields (`replace(tp=2)`)."""
        for (name, old), new in RENAMED_VALUES.items():
            if changes.get(name) == old:
                raise TrainConfigError(f"{name}={old!r} is now called {name}={new!r}")
        layout = {name: changes.pop(name) for name in LAYOUT_FIELDS if name in changes}
        if layout:
            requests = {name: changes.get(name, getattr(self, name)) for name in REQUESTS}
            changes["parallel"] = _layout(self.parallel, **requests, **layout)
        return dataclasses.replace(self, **changes)


def file_keys() -> tuple[str, ...]:
    """The keys of a training config file and its flags: the config's own fields, then the
    plan's (`parallel` itself is not a key: its fields are)."""
    own = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "parallel")
    return own + LAYOUT_FIELDS


def _layout(
    base: ParallelPlan, dp: int, micro_batch: int, num_microbatches: int | None, **fields: Any
) -> ParallelPlan:
    """`base` with `fields` and the requests filled in as the `parallel` field says (a layout
    error is a TrainConfigError naming the field)."""
    if "layers_per_stage" in fields and fields["layers_per_stage"] is None:
        fields["layers_per_stage"] = ()  # unset, as older run configs wrote it
    ep = fields.get("ep", base.ep)
    if dp == -1:  # the least dp that lays the experts out (a bad ep is the plan's to name)
        dp = ep if isinstance(ep, int) and not isinstance(ep, bool) and ep > 0 else 1
    try:
        return dataclasses.replace(
            base,
            **fields,
            dp=dp,
            micro_batch=micro_batch,
            num_microbatches=num_microbatches or 1,
        )
    except PlanError as exc:
        raise TrainConfigError(str(exc)) from None


# the file keys' types: the config's own fields and the plan's (older files wrote an unset
# layers_per_stage as null)
_SCHEMA = {
    **{k: v for k, v in dataclass_schema(TrainConfig).items() if k != "parallel"},
    **{k: v for k, v in dataclass_schema(ParallelPlan).items() if k in LAYOUT_FIELDS},
    "layers_per_stage": (LIST, NONE),
}
