"""HF-style model directories: `config.json` + one or sharded `*.safetensors`.

Parameter names are HF's with the `model.` prefix (our modules use HF's names without it), so a
directory we write loads in transformers and vice versa. Only safetensors: never unpickle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from llmopt.artifacts import atomic_write, atomic_write_text
from llmopt.models.config import ModelConfig

_PREFIX = "model."


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, corrupted or holds unexpected tensors."""


def hf_to_ours(name: str) -> str:
    return name.removeprefix(_PREFIX)


def ours_to_hf(name: str) -> str:
    """HF's name of a tensor or module (all but the LM head sit under `model.`)."""
    return name if name.split(".", 1)[0] == "lm_head" else _PREFIX + name


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory, in the shard order the index gives (if any)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
            raise ValueError(
                f"{directory} holds only pickled weights (*.bin/*.pt), which llmopt never "
                "unpickles; convert them to safetensors"
            )
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def read_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(directory / "config.json", name=directory.name)


def iter_tensors(directory: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every tensor of every shard, cast to `dtype`."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(directory):
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield hf_to_ours(key), handle.get_tensor(key).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise SafetensorsError(
                f"{path} ({size} bytes) is truncated or corrupted: {exc}"
            ) from exc


def save_directory(model: torch.nn.Module, directory: Path) -> None:
    """config.json + model.safetensors (a tied head is stored once, as HF does)."""
    from safetensors.torch import save_file

    config: ModelConfig = model.config
    directory.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        state[ours_to_hf(name)] = tensor.detach().to("cpu").contiguous()
    dtypes = {t.dtype for t in state.values()}
    hf_config = config.to_hf_config()
    if len(dtypes) == 1:
        hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    atomic_write(
        directory / "model.safetensors",
        lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}),
    )
    atomic_write_text(directory / "config.json", json.dumps(hf_config, indent=2))
