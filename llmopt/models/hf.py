"""HF-style model directories: `config.json` + one or sharded `*.safetensors`.

Parameter names are HF's with the `model.` prefix (our modules use HF's names without it), so a
directory we write loads in transformers and vice versa. Only safetensors: never unpickle.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from llmopt.artifacts import atomic_write, atomic_write_text
from llmopt.errors import LlmoptError
from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.hf_schema import (
    GENERATION_CONFIG,
    HF_CONFIG,
    INDEX_FILE,
    read_hf_json,
    read_index,
)
from llmopt.models.spec import ModelSpec, get_spec

_PREFIX = "model."
_ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


class SafetensorsError(LlmoptError, ValueError):
    """A safetensors file that is truncated, corrupted or holds unexpected tensors."""


def hf_to_ours(name: str) -> str:
    return name.removeprefix(_PREFIX)


def ours_to_hf(name: str) -> str:
    """HF's name of a tensor or module (all but the LM head sit under `model.`)."""
    return name if name.split(".", 1)[0] == "lm_head" else _PREFIX + name


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory, in the shard order the index gives (if any)."""
    files = read_index(directory)
    if files is not None:
        index = directory / INDEX_FILE
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
            raise SafetensorsError(
                f"{directory} holds only pickled weights (*.bin/*.pt), which llmopt never "
                "unpickles; convert them to safetensors"
            )
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def quant_method(directory: Path) -> str | None:
    """config.json's `quantization_config.quant_method` (lower case), or None if unquantized."""
    qc = read_hf_json(directory / "config.json", "HF config", HF_CONFIG).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise ConfigError(f"quantization_config={qc!r} in {directory} has no quant_method")
    return qc["quant_method"].lower()


def read_config(directory: Path) -> ModelConfig:
    """config.json, with the EOS ids of generation_config.json (which decide when HF stops)."""
    config = ModelConfig.from_hf_config(directory / "config.json", name=directory.name)
    gen_path = directory / "generation_config.json"
    if not gen_path.is_file():
        return config
    eos = read_hf_json(gen_path, "generation config", GENERATION_CONFIG).get("eos_token_id")
    if eos is None:
        return config
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{gen_path}: eos_token_id={eos!r} must be an integer or a list of them")
    first = config.eos_token_id if config.eos_token_id in ids else ids[0]
    return config.replace(eos_token_id=first, eos_token_ids=tuple(ids) if len(ids) > 1 else ())


def drop_rotary_buffers(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Skip saved RoPE `inv_freq` buffers (older transformers saved them), after checking they
    agree with the config's RoPE: a mismatch means the config misdescribes the checkpoint."""
    from llmopt.models.llama import rope_frequencies

    expected = rope_frequencies(config)
    for name, tensor in tensors:
        if name.rsplit(".", 1)[-1] not in _ROTARY_BUFFERS or "rotary_emb" not in name:
            yield name, tensor
            continue
        if name.endswith(".inv_freq") and (
            tensor.shape != expected.shape
            or not torch.allclose(tensor.float(), expected, rtol=1e-3, atol=0.0)
        ):
            raise ConfigError(
                f"{source}: saved {name} does not match the RoPE of the config "
                f"(rope_theta={config.rope_theta}, rope_scaling={config.rope_scaling})"
            )


def _norm_weight(name: str, spec: ModelSpec) -> bool:
    """Whether `name` (ours) is the weight of a block norm or of the final norm."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return False
    parts = module.split(".")
    inner = ".".join(parts[2:]) if parts[0] == spec.blocks and len(parts) > 2 else None
    return module == spec.final_norm or inner in spec.block_norms


def _split_name(name: str, spec: ModelSpec) -> tuple[str, str, str] | None:
    """(block prefix, block-level module, leaf) of a block tensor name, else None."""
    parts = name.split(".")
    if parts[0] != spec.blocks or len(parts) < 4:
        return None
    return ".".join(parts[:2]), ".".join(parts[2:-1]), parts[-1]


def _renamed(name: str, spec: ModelSpec, to_hf: bool) -> str:
    """`name` with the spec's block-level module renames applied (Mixtral's expert names)."""
    parts = name.split(".")
    if not spec.hf_renames or parts[0] != spec.blocks or len(parts) < 3:
        return name
    inner = ".".join(parts[2:])
    for ours, hf in spec.hf_renames:
        src, dst = (ours, hf) if to_hf else (hf, ours)
        pattern = "^" + re.escape(src).replace(r"\*", r"(\d+)") + r"\."
        inner = re.sub(pattern, dst.replace("*", r"\1") + ".", inner)
    return ".".join([*parts[:2], inner])


def from_hf_layout(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors in our layout: names renamed (Mixtral's block_sparse_moe), fused
    tensors (Phi-3's qkv_proj, gate_up_proj) split into their parts along rows, norm weights
    shifted by the spec's offset (Gemma's 1 + w)."""
    spec = get_spec(config.architecture)
    fused = {g.name: g.parts for g in spec.hf_fused}
    rows = _part_rows(config) if fused else {}
    for name, tensor in tensors:
        name = _renamed(name, spec, to_hf=False)
        split = _split_name(name, spec)
        if split is not None and split[1] in fused and split[2] in ("weight", "bias"):
            prefix, module, leaf = split
            sizes = [rows[part] for part in fused[module]]
            if tensor.shape[0] != sum(sizes):
                raise SafetensorsError(
                    f"fused tensor {name!r} has {tensor.shape[0]} rows; the config implies "
                    f"{' + '.join(map(str, sizes))} for {', '.join(fused[module])}"
                )
            for part, piece in zip(fused[module], torch.split(tensor, sizes, dim=0)):
                yield f"{prefix}.{part}.{leaf}", piece.contiguous()
            continue
        if spec.norm_weight_offset and _norm_weight(name, spec):
            tensor = tensor + spec.norm_weight_offset
        yield name, tensor


def _part_rows(config: ModelConfig) -> dict[str, int]:
    """Output rows of every block-level linear (read off a one-block model on meta)."""
    from llmopt.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(config.replace(num_layers=1))
    spec = get_spec(config.architecture)
    block = spec.blocks_of(model)[0]
    return {n: m.weight.shape[0] for n, m in spec.named_block_modules(block, spec.block_linears)}


def to_hf_layout(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under HF's names and layout (the inverse of `from_hf_layout`)."""
    spec = get_spec(config.architecture)
    parts_of = {part: g for g in spec.hf_fused for part in g.parts}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        split = _split_name(name, spec)
        group = parts_of.get(split[1]) if split is not None else None
        if group is not None and split[1] == group.parts[0]:
            prefix, _, leaf = split
            pieces = [state.get(f"{prefix}.{part}.{leaf}") for part in group.parts]
            if any(p is None for p in pieces):
                raise ValueError(f"cannot fuse {group.name} of {prefix}: a part lacks {leaf}")
            out[ours_to_hf(f"{prefix}.{group.name}.{leaf}")] = torch.cat(pieces).contiguous()
            continue
        if group is not None:
            continue  # written with the group's first part
        if spec.norm_weight_offset and _norm_weight(name, spec):
            tensor = tensor - spec.norm_weight_offset
        out[ours_to_hf(_renamed(name, spec, to_hf=True))] = tensor.contiguous()
    return out


def iter_tensors(directory: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every tensor of every shard; floating ones cast to `dtype`
    (integer tensors, e.g. packed quantized codes, keep their dtype)."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(directory):
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = handle.get_tensor(key)
                    if tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    yield hf_to_ours(key), tensor
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise SafetensorsError(
                f"{path} ({size} bytes) is truncated or corrupted: {exc}"
            ) from exc


def save_directory(model: torch.nn.Module, directory: Path) -> None:
    """config.json + model.safetensors (a tied head is stored once, as HF does)."""
    from safetensors.torch import save_file

    config: ModelConfig = model.config
    directory.mkdir(parents=True, exist_ok=True)
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        ours[name] = tensor.detach().to("cpu")
    state = to_hf_layout(ours, config)
    dtypes = {t.dtype for t in state.values()}
    hf_config = config.to_hf_config()
    if len(dtypes) == 1:
        hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    atomic_write(
        directory / "model.safetensors",
        lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}),
    )
    atomic_write_text(directory / "config.json", json.dumps(hf_config, indent=2))
