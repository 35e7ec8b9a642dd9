"""Assemble a `Transformer` from (name, tensor) pairs on the meta device: every loader's last
step (GGUF, HF safetensors, pruned directories, merged LoRA, exports), with one check that the
tensors are exactly those the config implies."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from llmopt.models.config import ModelConfig
from llmopt.models.hf import SafetensorsError
from llmopt.models.llama import RotaryEmbedding, Transformer


def model_from_tensors(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
    source: str = "checkpoint",
    modules: dict[str, nn.Module] | None = None,
) -> Transformer:
    """Assemble a `Transformer` from (name, tensor) pairs without initialising it first.

    Every parameter must be supplied with the shape the config implies; a tied head may be
    supplied or not (it is the embedding either way). `modules` (qualified name -> module,
    e.g. packed linears) replace the model's own before loading; their tensors are not
    expected among `tensors`.
    """
    with torch.device("meta"):
        model = Transformer(config)
    for name, module in (modules or {}).items():
        model.set_submodule(name, module.to(device))
    expected = {
        name: p.shape
        for name, p in model.state_dict().items()
        if name.rsplit(".", 1)[0] not in (modules or {})
    }
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        if name not in expected:
            raise SafetensorsError(
                f"{source}: unexpected tensor {name!r} for a {config.num_layers}-layer "
                f"{config.architecture} model"
            )
        if not tensor.is_floating_point():
            raise SafetensorsError(
                f"{source}: tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}"
                "; model weights must be floating point (float32, bfloat16 or float16)"
            )
        if tensor.shape != expected[name]:
            raise SafetensorsError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name])}"
            )
        state[name] = tensor.to(device)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        raise SafetensorsError(f"{source} lacks tensors the config needs: {shown}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings and "lm_head" not in (modules or {}):
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(config).to(device)  # non-persistent buffers stayed on meta
    return model.eval()
