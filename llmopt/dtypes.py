"""The one dtype vocabulary of llmopt's commands and APIs.

Canonical names are torch's (which transformers and vLLM use too): float32, bfloat16,
float16. The short spellings other tools use (fp32, bf16, fp16, half, ...) are accepted as
aliases and read as the canonical name, so `--dtype fp16` and `--dtype float16` mean the same
on every command; anything else is refused with the valid values listed. `--precision`
(fp32|bf16|fp8, a training precision recipe as Megatron and torchtitan name it) is another
concept and keeps its names (`llmopt.parallel.plan.PRECISIONS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmopt.errors import LlmoptError

if TYPE_CHECKING:
    import torch

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ALIASES: dict[str, str] = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
}  # fmt: skip
# words some flags offer beside a dtype: "auto" (keep a GGUF's blocks), "keep" (as loaded)
NOT_DTYPES: tuple[str, ...] = ("auto", "keep")


class DtypeError(LlmoptError, ValueError):
    """A dtype name outside the vocabulary (the message lists the valid ones)."""


def dtype_name(value: str, valid: tuple[str, ...] = DTYPES) -> str:
    """The canonical name of `value` (an alias reads as its canonical name); DtypeError
    listing `valid` for anything else, or for a dtype outside `valid`."""
    name = value if value in DTYPES or value in NOT_DTYPES else ALIASES.get(value.lower())
    if name is None or name not in valid:
        aliases = sorted(a for a, n in ALIASES.items() if n in valid)
        also = f" (or the aliases {', '.join(aliases)})" if aliases else ""
        raise DtypeError(
            f"dtype={value!r} is not supported; valid choices: {', '.join(valid)}{also}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of the vocabulary (or one of its aliases)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype_name(name)
    ]
