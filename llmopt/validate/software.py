"""What software a published run ran, read from its row: the year its source dates the software
by, the fused attention kernel generation, Megatron-Core's named recompute / offload modules,
and the kernel traits of the framework (`llmopt.plan.frameworks.FRAMEWORK_KERNELS` for the CLI;
here from the row's own text, which may say more).
"""

from __future__ import annotations

import re

from llmopt.validate.cells import RowError


def software_years(row: dict[str, str]) -> list[int]:
    """Years the row's source dates its software by: 4-digit years, and NeMo containers
    ("25.11 NeMo Container", "NeMo24.03.01", "Container NeMo 25.02")."""
    text = row["source"] + " " + row["locator"]
    years = [int(y) for y in re.findall(r"\b(20[12]\d)\b", text)]
    nemo = r"(?:NeMo\s*(\d\d)\.\d\d|\b(\d\d)\.\d\d(?:\.\d+)?\s+NeMo Container)"
    years += [2000 + int(a or b) for a, b in re.findall(nemo, text)]
    return years


def attention_kernel(row: dict[str, str], years: list[int]) -> str:
    """The fused attention generation a row ran (`Workload.attention_kernel`): the `attention`
    column if given; PyTorch SDPA's flash backend (FlashAttention-2) for torchtitan and
    DeepSpeed; FlashAttention-2-generation kernels for software of 2024 and before; else the
    current generation."""
    given = (row.get("attention") or "").strip().lower()
    if given:
        if given not in ("fa2", "fa3"):
            raise RowError(f"attention={given!r}; use fa2 or fa3")
        return given
    framework = (row.get("framework") or "").strip().lower()
    if framework in ("torchtitan", "deepspeed") or (years and max(years) <= 2024):
        return "fa2"
    return "fa3"


# How sources name Megatron-Core's selective recompute / offload modules
_MODULE_WORDS = {
    "norm": "layernorm", "layernorm": "layernorm", "rmsnorm": "layernorm", "act": "moe_act",
    "moe_act": "moe_act", "moe": "moe", "mlp": "mlp", "up_proj": "mla_up_proj",
    "mla_up_proj": "mla_up_proj", "mla up-projection": "mla_up_proj", "expert_fc1": "expert_fc1",
    "shared_experts": "shared_experts", "attn_proj": "attn_proj", "core_attn": "core_attn",
}  # fmt: skip


def recompute_modules(row: dict[str, str]) -> tuple[str, ...]:
    """Megatron-Core modules a row's "selective (a, b)" recompute cell and its "activation
    offloading (c, d)" note name; () when the row names none the planner knows (its own
    selective then applies)."""
    found = []
    for cell in (row["recompute"], *re.findall(r"offloading\s*(\([^)]*\))", row["notes"])):
        m = re.search(r"\(([^)]*)\)", cell)
        words = [w.strip().lower() for w in m.group(1).split(",")] if m else []
        found += [_MODULE_WORDS[w] for w in words if w in _MODULE_WORDS]
    return tuple(dict.fromkeys(found))


def kernel_traits(row: dict[str, str], years: list[int], fp8: bool) -> dict[str, object]:
    """`Workload` fields of the row's kernels: attention generation, what "selective" recomputes
    (torchtitan's op-level SAC reruns every second matmul), torchao's Float8 casts, FP8 weight
    gathers ("float8 all-gather"), bf16 Adam moments (DeepSeek-V3 report §3.3.3, or a source
    saying "BF16 optimizer states") and named recompute / offload modules."""
    framework = (row.get("framework") or "").strip().lower()
    titan = framework == "torchtitan"
    text = (row.get("precision", "") + " " + row["notes"]).lower()
    bf16_moments = framework == "deepseek" or re.search(
        r"bf16 (optimizer states|adam moments|moments)", text
    )
    return {
        "attention_kernel": attention_kernel(row, years),
        "selective": "every-other-mm" if titan else "memory-bound",
        "fp8_casts": "torchao" if titan and fp8 else "fused",
        "fp8_param_gather": fp8 and ("float8 all-gather" in text or "fp8 all-gather" in text),
        "recompute_modules": recompute_modules(row),
        "moments": "bf16" if bf16_moments else "fp32",
    }
