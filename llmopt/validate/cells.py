"""Free-text cells of the published-run CSVs, read robustly (training and serving rows).

Sources state numbers loosely ("~2K (4M tokens)", "32000 padded", "FSDP: off", "ZeRO-1-like",
"not stated", "not verified"). Each reader returns the value, None when the source left it open
(the planner then chooses, and says so), or raises `RowError` naming the cell when the text
cannot be understood: a row is never silently misread, and a blank is never a refusal.
"""

from __future__ import annotations

import dataclasses
import re

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.models.moe import MoEConfig
from llmopt.models.presets import get_preset

NOT_STATED = (
    "", "-", "?", "n/a", "na", "none given", "not stated", "not reported", "not verified",
    "unverified", "unknown",
)  # fmt: skip
_OPEN_WORDS = ("not reported", "not stated", "not verified", "unverified")
_SCALE = {"": 1, "k": 1024, "m": 1024**2, "b": 1024**3}
_NUMBER = r"~?\s*(\d[\d,]*(?:\.\d+)?)([kmb]?)(?![a-z])"


class RowError(LlmoptError, ValueError):
    """A CSV row (or one of its cells) that cannot be understood."""


def is_blank(text: str) -> bool:
    """The source left this cell open ("", "not stated", "n/a", ...)."""
    t = (text or "").strip().lower()
    return t in NOT_STATED or any(w in t for w in _OPEN_WORDS)


def count(text: str, what: str, seq_len: int | None = None, allow_zero: bool = False) -> int | None:
    """An integer cell: "1024", "1,024", "32000 padded", "2K", "~2K (4M tokens)" (a token
    count in parentheses wins when `seq_len` converts it), or None if not stated. Zero is a
    value only where `allow_zero` (e.g. a MoE with no shared expert)."""
    if is_blank(text):
        return None
    t = text.strip().lower()
    tokens = re.search(_NUMBER + r"\s*tokens", t)
    if tokens and seq_len:
        n = float(tokens.group(1).replace(",", "")) * _SCALE[tokens.group(2)]
        if n % seq_len:
            raise RowError(
                f"{what}={text!r}: {n:.0f} tokens is not a multiple of seq_len {seq_len}"
            )
        return int(n // seq_len)
    m = re.match(_NUMBER + r"(?![\d.])(.*)$", t)
    if not m or re.match(r"[a-z]", m.group(3)):  # "4h": a unit llmopt does not know
        raise RowError(f"{what}={text!r} is not a number")
    rest = m.group(3)
    if re.search(r"\d", rest) and not re.search(r"tokens", rest):
        raise RowError(f"{what}={text!r} gives more than one number; state one")
    value = float(m.group(1).replace(",", "")) * _SCALE[m.group(2)]
    if value != int(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "a non-negative" if allow_zero else "a positive"
        raise RowError(f"{what}={text!r} is not {kind} integer")
    return int(value)


def number(text: str, what: str) -> float | None:
    """A measured figure ("5,630", "5630 tok/s"); None if not stated."""
    if is_blank(text):
        return None
    m = re.match(r"\s*(\d[\d,]*(?:\.\d+)?)(?![\d.])", text)
    if not m or re.search(r"\d", text[m.end() :].split("(")[0]):
        raise RowError(f"{what}={text!r} is not one number")
    return float(m.group(1).replace(",", ""))


def zero_stage(text: str) -> int | None:
    """ZeRO stage of a sharding cell: "none", "FSDP: off", "DDP" -> 0; "ZeRO-1-like",
    "distributed optimizer" -> 1; "ZeRO-2" -> 2; "FSDP", "ZeRO-3" -> 3; None if not stated."""
    if is_blank(text):
        return None
    t = text.strip().lower()
    m = re.search(r"zero[\s-]*(\d)", t)
    if m and m.group(1) in "0123":
        return int(m.group(1))
    if t.startswith("distributed optimizer"):
        return 1
    if "fsdp" in t:
        return 0 if re.search(r"fsdp\s*[:=]?\s*(off|no|0|false|disabled)\b", t) else 3
    if t.startswith(("none", "off", "ddp", "0", "no")):
        return 0
    raise RowError(f"zero_fsdp={text!r} is not understood (none, ZeRO-1..3, FSDP, DDP)")


def flag(text: str, what: str) -> bool | None:
    """yes/no cell; None if not stated."""
    if is_blank(text):
        return None
    t = text.strip().lower()
    if t.startswith(("yes", "true", "on")):
        return True
    if t.startswith(("no", "false", "off")):
        return False
    raise RowError(f"{what}={text!r} is not yes/no")


MOE_COLUMNS = ("experts", "top_k", "shared_experts", "expert_ffn_hidden", "moe_layers")


def row_preset(row: dict[str, str], notes: list[str]) -> ModelConfig | None:
    """The row's preset (its `model` cell names one and no shapes are given), checked against
    any MoE columns the row fills; None when the row gives shapes."""
    if count(row.get("layers", ""), "layers") is not None:
        return None
    try:
        model = get_preset(row["model"].strip())
    except KeyError:
        raise RowError(f"model={row['model']!r} is neither a preset nor given by shapes") from None
    notes.append(f"preset {model.name}")
    moe = model.moe
    have = {"experts": moe and moe.num_experts, "top_k": moe and moe.top_k,
            "shared_experts": moe and moe.shared_experts,
            "expert_ffn_hidden": moe and moe.expert_ffn_hidden,
            "moe_layers": moe and (moe.moe_layers or model.num_layers)}  # fmt: skip
    for col in MOE_COLUMNS:
        given = count(row.get(col, ""), col, allow_zero=col == "shared_experts")
        if given is not None and given != (have[col] or 0):
            raise RowError(f"{col}={given} contradicts preset {model.name} ({have[col] or 0})")
    mtp = count(row.get("mtp_layers", ""), "mtp_layers", allow_zero=True)
    if mtp is not None and moe is not None and mtp != moe.mtp_layers:  # e.g. "w/o MTP" runs
        model = model.replace(moe=dataclasses.replace(moe, mtp_layers=mtp))
        notes.append(f"mtp_layers={mtp}")
    return model


def moe_of_columns(row: dict[str, str], layers: int) -> MoEConfig | None:
    experts = count(row.get("experts", ""), "experts")
    if experts is None or experts <= 1:
        return None
    top_k, ffn = (
        count(row.get("top_k", ""), "top_k"),
        count(row.get("expert_ffn_hidden", ""), "ffn"),
    )
    if top_k is None or ffn is None:
        raise RowError(f"experts={experts} needs top_k and expert_ffn_hidden")
    shared = count(row.get("shared_experts", ""), "shared_experts", allow_zero=True) or 0
    n_moe = count(row.get("moe_layers", ""), "moe_layers") or layers
    return MoEConfig(experts, top_k, ffn, moe_layers=n_moe, shared_experts=shared)
