"""LoRA (and QLoRA) adapters: y = base(x) + (alpha/r) * B(A(dropout(x))) on chosen linears.

`apply_lora` wraps the targeted linears of every block (names come from the model spec:
`all`, `attention`, `feed_forward` or a comma-separated list matched against the spec's block linears)
and turns every other parameter into a buffer of the frozen base dtype: the engine's data
parallelism (DP, ZeRO 0-3) then buckets, reduces, shards and optimizes the adapters only, and
the frozen base is never given gradients, masters or optimizer states. With `quantize_bits=4`
the base linears become our packed INT4 `QuantLinear` (RTN, QLoRA) computed by exact
dequantisation, which is differentiable in its input.

Adapters are saved in PEFT's layout (`adapter_config.json`, `adapter_model.safetensors` with
peft's key names: `base_model.model.<HF module>.lora_A.weight`), so `peft` loads them onto
transformers' model; `merged_model` folds them into a plain model (`llmopt merge`). The
config's `base_model_name_or_path` is what transformers resolves: a HF directory's absolute
path (so `AutoPeftModelForCausalLM.from_pretrained(adapter)` works from any directory) or a
Hub id as given; a GGUF base (a packaged name) is written as the file's absolute path, which
transformers opens with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` before
`PeftModel.from_pretrained` (AutoPeft cannot pass `gguf_file`). Beside them,
`llmopt_adapter.json` holds a fingerprint of the base weights the adapter was trained on
(the tensors LoRA leaves alone), so a merge onto another base of the same shape is refused
instead of producing a silently wrong model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.artifacts import atomic_write, atomic_write_text
from llmopt.errors import LlmoptError
from llmopt.models.spec import ModelSpec, spec_for

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
BASE_FILE = "llmopt_adapter.json"  # our note beside peft's files: which base the adapter fits


class LoraError(LlmoptError, ValueError):
    """Adapters that cannot be applied, saved or loaded as asked."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "all"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class FrozenLinear(nn.Module):
    """A linear whose weight (and bias) are buffers in the frozen base dtype; computes in it
    and returns the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.float()


class _FrozenQuantMatmul(torch.autograd.Function):
    """y = x W^T for a packed (frozen) QuantLinear that saves nothing but the module: backward
    dequantizes W again, tile by tile, for dx = dy W. Autograd through the dequantizing matmul
    would keep every dequantized tile for backward, as much memory as a bf16 base."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from llmopt.models.packed.quant.format import dequantize_codes, unpack_codes

        layer = ctx.layer
        g2 = grad.reshape(-1, layer.out_features)
        gx = g2.new_zeros(g2.shape[0], layer.in_features)
        for r0 in range(0, layer.out_features, layer.tile_rows):
            r1 = min(r0 + layer.tile_rows, layer.out_features)
            codes = unpack_codes(layer.qweight[r0:r1], layer.bits, layer.in_features)
            w = dequantize_codes(
                codes, layer.scales[r0:r1], layer.zeros[r0:r1], layer.group_size, dtype=g2.dtype
            )
            gx += g2[:, r0:r1] @ w
        return gx.reshape(*grad.shape[:-1], layer.in_features), None


class LoraLinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update (PEFT's parameterisation)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, s: LoraSettings):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.lora_A = nn.Linear(in_features, s.rank, bias=False)
        self.lora_B = nn.Linear(s.rank, out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = s.scaling
        self.dropout = nn.Dropout(s.dropout) if s.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = hasattr(self.base, "qweight")
        y = _FrozenQuantMatmul.apply(x, self.base) if quantized else self.base(x)
        a = self.lora_A.weight
        update = self.lora_B(self.lora_A(self.dropout(x.to(a.dtype)))) * self.scaling
        return y + update.to(y.dtype)

    def base_weight(self) -> torch.Tensor:
        base = self.base
        return (
            base.dequantize(torch.float32) if hasattr(base, "dequantize") else base.dense_weight()
        )

    def base_bias(self) -> torch.Tensor | None:
        return None if self.base.bias is None else self.base.bias.detach().float()


def resolve_targets(spec: ModelSpec, targets: str) -> tuple[str, ...]:
    """Block-level linear names (the spec's) that `targets` selects."""
    linears = spec.block_linears
    groups = {
        "all": linears,
        "attention": tuple(n for n in linears if n.startswith(spec.attention + ".")),
        "feed_forward": tuple(n for n in linears if n.startswith(spec.feed_forward + ".")),
    }
    if targets in groups:
        return groups[targets]
    chosen: list[str] = []
    for item in (t.strip() for t in targets.split(",") if t.strip()):
        hits = [n for n in linears if n == item or n.endswith("." + item)]
        if not hits:
            short = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise LoraError(
                f"lora target {item!r} matches no linear of a {spec.architecture} block; "
                f"valid: all, attention, feed_forward or any of {', '.join(short)}"
            )
        chosen += [h for h in hits if h not in chosen]
    if not chosen:
        raise LoraError(f"lora_targets={targets!r} selects nothing")
    return tuple(chosen)


def _frozen_base(linear: nn.Module, dtype: torch.dtype, quantize_bits: int | None) -> nn.Module:
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    if quantize_bits is None:
        return FrozenLinear(weight.to(dtype), None if bias is None else bias.to(dtype))
    from llmopt.models.packed.quant.format import pack_weight
    from llmopt.models.packed.quant.linear import QuantLinear

    packed = pack_weight(weight.float(), bits=quantize_bits, group_size=64)
    layer = QuantLinear.from_packed(packed, bias=bias, backend="dequant")  # differentiable
    if layer.bias is not None:
        layer.bias.data = layer.bias.data.to(dtype)
    return layer


def apply_lora(
    model: nn.Module,
    settings: LoraSettings,
    base_dtype: torch.dtype = torch.float32,
    quantize_bits: int | None = None,
) -> list[str]:
    """Wrap the targeted linears in place, freeze the rest; returns the wrapped module names."""
    if settings.rank < 1:
        raise LoraError(f"lora rank={settings.rank} must be >= 1")
    spec = spec_for(model)
    targets = resolve_targets(spec, settings.targets)
    wrapped = []
    for block_name, block in spec.named_blocks(model):
        for name, linear in spec.named_block_modules(block, targets):
            parent_name, _, leaf = name.rpartition(".")
            parent = spec.block_module(block, parent_name) if parent_name else block
            out_features, in_features = linear.weight.shape
            base = _frozen_base(linear, base_dtype, quantize_bits)
            lora = LoraLinear(base, in_features, out_features, settings)
            setattr(parent, leaf, lora.to(linear.weight.device))
            wrapped.append(f"{block_name}.{name}")
    if not wrapped:
        raise LoraError(f"lora_targets={settings.targets!r} wrapped no module of this model")
    freeze_base(model, base_dtype)
    return wrapped


def freeze_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter that is not an adapter becomes a buffer in `dtype` (tied weights stay
    one tensor)."""
    converted: dict[int, torch.Tensor] = {}
    adapters = {id(m) for m in _adapter_linears(model)}
    for module in model.modules():
        if id(module) in adapters:
            continue
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in converted:
                data = param.detach()
                converted[id(param)] = data.to(dtype) if data.is_floating_point() else data
            del module._parameters[name]
            module.register_buffer(name, converted[id(param)])


def _adapter_linears(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for lora in model.modules()
        if isinstance(lora, LoraLinear)
        for m in (lora.lora_A, lora.lora_B)
    ]


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by our parameter name."""
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def merged_model(model: nn.Module, adapters: Mapping[str, torch.Tensor] | None = None):
    """A plain `Transformer` (fp32) with W + (alpha/r) B A folded in. `adapters` (by our name,
    e.g. the engine's gathered fp32 masters) override the modules' own values."""
    from llmopt.models.loading import model_from_tensors

    adapters = dict(adapters_or_own(model, adapters))
    modules = lora_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not any(name.startswith(p + ".") for p in modules):
            tensors[name] = tensor.detach().float() if tensor.is_floating_point() else tensor
    for path, lora in modules.items():
        a, b = adapters[f"{path}.lora_A.weight"].float(), adapters[f"{path}.lora_B.weight"].float()
        tensors[f"{path}.weight"] = lora.base_weight() + lora.scaling * (b @ a)
        bias = lora.base_bias()
        if bias is not None:
            tensors[f"{path}.bias"] = bias
    return model_from_tensors(model.config, tensors.items(), source="merged LoRA model")


def adapters_or_own(model: nn.Module, adapters: Mapping[str, torch.Tensor] | None):
    own = adapter_state(model)
    if adapters is None:
        return own
    missing = sorted(set(own) - set(adapters))
    if missing:
        raise LoraError(f"adapter state lacks {len(missing)} tensors, e.g. {missing[0]}")
    return {n: adapters[n] for n in own}


# ---- PEFT layout ----
def peft_base_reference(base_model: str | None) -> str | None:
    """`base_model_name_or_path` for a base given as llmopt takes it (see the module doc)."""
    if base_model is None:
        return None
    from llmopt.models.hub_cache import looks_like_hub_id
    from llmopt.models.loading import resolve_spec

    path = Path(base_model).expanduser()
    if not path.exists() and looks_like_hub_id(base_model):
        return base_model  # transformers resolves Hub ids itself (cache or download)
    _, resolved = resolve_spec(base_model)  # a packaged name -> its GGUF file
    return str(resolved.resolve())


def save_adapter(
    model: nn.Module,
    directory: str | Path,
    settings: LoraSettings,
    base_model: str | None = None,
    adapters: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """adapter_config.json + adapter_model.safetensors, peft's names; each file atomic."""
    from safetensors.torch import save_file

    from llmopt.models.hf import ours_to_hf

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        PEFT_PREFIX + ours_to_hf(n): t.detach().float().cpu().contiguous()
        for n, t in adapters_or_own(model, adapters).items()
    }
    leaves = sorted({p.rsplit(".", 1)[-1] for p in lora_modules(model)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": leaves,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": peft_base_reference(base_model),
    }
    atomic_write(directory / ADAPTER_FILE, lambda tmp: save_file(state, str(tmp), {"format": "pt"}))
    atomic_write_text(directory / CONFIG_FILE, json.dumps(config, indent=2))
    note = {"format": "llmopt-adapter", "version": 1, "base_fingerprint": base_fingerprint(model)}
    atomic_write_text(directory / BASE_FILE, json.dumps(note, indent=2))
    return directory


def base_fingerprint(model: nn.Module) -> str:
    """SHA-256 of the base tensors LoRA leaves alone (embeddings, norms, untargeted linears),
    each rounded to bfloat16 so a base frozen in bf16 and the same base loaded in fp32 agree."""
    import hashlib

    modules = tuple(p + "." for p in lora_modules(model))
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if ".lora_" in name or name.startswith(modules) or not tensor.is_floating_point():
            continue
        values = tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
        digest.update(name.encode() + b"\0" + values.numpy().tobytes())
    return digest.hexdigest()


def check_base(directory: str | Path, model: nn.Module, base: str) -> bool:
    """Refuse a base whose fingerprint differs from the one the adapter recorded; False when
    the adapter has no fingerprint (written elsewhere, e.g. by peft): nothing to check."""
    note_path = Path(directory) / BASE_FILE
    if not note_path.is_file():
        return False
    from llmopt.config_files import read_json

    recorded = read_json(note_path, "adapter note").get("base_fingerprint")
    if not isinstance(recorded, str):
        raise LoraError(f"{note_path}: base_fingerprint={recorded!r} must be a hex string")
    found = base_fingerprint(model)
    if found != recorded:
        raise LoraError(
            f"adapter {directory} was trained on another base than --base {base} (its weights "
            f"differ: fingerprint {found[:12]} vs the adapter's {recorded[:12]}); merge onto "
            "the model the adapter was trained on"
        )
    return True


def read_adapter(directory: str | Path) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """(settings, adapter tensors by our name) of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    from llmopt.models.hf import hf_to_ours

    directory = Path(directory)
    for name in (CONFIG_FILE, ADAPTER_FILE):
        if not (directory / name).is_file():
            raise LoraError(f"{directory} is not a PEFT adapter directory: no {name}")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise LoraError(
            f"{directory}: peft_type={config.get('peft_type')!r}; only LORA is supported"
        )
    if config.get("use_dora") or config.get("use_rslora"):
        raise LoraError(f"{directory}: DoRA / rsLoRA adapters are not supported")
    targets = config.get("target_modules") or []
    settings = LoraSettings(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0),
        targets=",".join(targets) if isinstance(targets, list) else str(targets),
    )
    tensors = {}
    for key, value in load_file(str(directory / ADAPTER_FILE)).items():
        if not key.startswith(PEFT_PREFIX):
            raise LoraError(f"{directory}: unexpected adapter key {key!r}")
        tensors[hf_to_ours(key.removeprefix(PEFT_PREFIX))] = value
    return settings, tensors
