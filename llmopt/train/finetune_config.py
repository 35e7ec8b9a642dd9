"""Validation of the fine-tuning fields of `TrainConfig` (data formats, LoRA, outputs, logging).

Kept beside the config so its checks stay one line each: a bad value is refused before any
process starts, naming the value and what is valid.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

SAVE_FORMATS = ("resume", "hf", "both", "all")
REPORTERS = ("tensorboard", "wandb", "mlflow")
DATA_FORMATS = ("auto", "text", "prompt_completion", "messages")


def report_targets(report_to: str) -> list[str]:
    return [t.strip() for t in report_to.split(",") if t.strip()]


def validate_finetune(cfg: Any, error: type[ValueError]) -> None:
    """Raise `error` for the first invalid fine-tuning field of `cfg`."""
    if cfg.format not in DATA_FORMATS:
        raise error(f"format={cfg.format!r} is not valid; choose one of {DATA_FORMATS}")
    if cfg.format != "auto" and cfg.data is None:
        raise error(f"format={cfg.format!r} applies to --data; give --data FILE")
    fraction = cfg.eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise error(f"eval_fraction={fraction!r} must be a number in [0, 1)")
    if not (math.isfinite(fraction) and 0 <= fraction < 1):
        raise error(f"eval_fraction={fraction!r} must be in [0, 1)")
    if (
        cfg.data is not None
        and fraction > 0
        and (cfg.parallel.pp > 1 or cfg.parallel.zero_stage == 3)
    ):
        raise error(
            f"the held-out loss needs pp=1 and zero_stage<=2 (got pp={cfg.parallel.pp}, "
            f"zero_stage={cfg.parallel.zero_stage}); pass --eval-fraction 0 to train without it"
        )
    if cfg.eval_every < 0:
        raise error(f"eval_every={cfg.eval_every} must be >= 0")
    if isinstance(cfg.lora_rank, bool) or cfg.lora_rank < 0:
        raise error(f"lora_rank={cfg.lora_rank!r} must be >= 0 (0: no adapters)")
    if not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
        raise error(f"lora_alpha={cfg.lora_alpha!r} must be a positive finite number")
    if not (math.isfinite(cfg.lora_dropout) and 0 <= cfg.lora_dropout < 1):
        raise error(f"lora_dropout={cfg.lora_dropout!r} must be in [0, 1)")
    if cfg.qlora and cfg.lora_rank == 0:
        raise error("qlora=True needs adapters: give --lora-rank R (e.g. 8)")
    if cfg.lora_rank:
        for name in ("tp", "pp"):
            if getattr(cfg.parallel, name) != 1:
                raise error(
                    f"LoRA with {name}={getattr(cfg.parallel, name)} is not supported: adapters train "
                    f"on data parallelism (dp, ZeRO 0-3) only; use {name}=1"
                )
        if cfg.parallel.precision == "fp8":
            raise error("LoRA with precision=fp8 is not supported; use fp32 or bf16")
    if cfg.save_format not in SAVE_FORMATS:
        raise error(f"save_format={cfg.save_format!r} is not valid; choose one of {SAVE_FORMATS}")
    for target in report_targets(cfg.report_to):
        if target not in REPORTERS:
            raise error(f"report_to target {target!r} is not valid; choose from {REPORTERS}")
        if importlib.util.find_spec(target) is None:
            raise error(
                f"report_to={target} needs the {target!r} package, which is not installed "
                f"(pip install {target})"
            )
