"""One entry point for real weights: packaged names, GGUF files, HF directories, quantized dirs.

Models are built on the meta device and the loaded tensors are assigned in place of the meta
parameters, so no time goes into a random init that would be overwritten, and no second copy
of the weights is ever held.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.config_files import read_json
from llmopt.errors import UsageError
from llmopt.models.assemble import model_from_tensors
from llmopt.models.config import ModelConfig
from llmopt.models.directory_formats import (
    directory_format,
    get_directory_format,
    quantization_loader,
    registered_markers,
)
from llmopt.models.finite import check_finite_weights
from llmopt.models.gguf import GGUFError
from llmopt.models.hub_cache import cached_snapshot, looks_like_hub_id
from llmopt.models.llama import Transformer
from llmopt.models.registry import is_model_name, resolve
from llmopt.models.tokenizer import Tokenizer


def resolve_spec(spec: str | Path) -> tuple[str, Path]:
    """(kind, path) for a model spec; kind is 'gguf', 'hf' or a registered directory format
    ('quant': an `llmopt quantize` output). A Hub id that is not a local path is looked up in
    the local HF cache."""
    spec = str(spec)
    if is_model_name(spec):
        return "gguf", resolve(spec)
    path = Path(spec).expanduser()
    if not path.exists() and looks_like_hub_id(spec):
        path = cached_snapshot(spec)  # raises naming the cache when it is not there
    if not path.exists():
        if "/" not in spec and "\\" not in spec and not Path(spec).suffix:
            resolve(spec)  # raises the 'unknown model' error with the known names
        raise FileNotFoundError(f"model file or directory not found: {spec}")
    if path.is_dir():
        fmt = directory_format(path)
        if fmt is not None:
            return fmt.kind, path
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # e.g. a Hub snapshot of a GGUF-only repository
            return "gguf", ggufs[0]
        markers = " or ".join(["config.json", *registered_markers()])
        raise FileNotFoundError(
            f"{path} is a directory without {markers}; expected a HF model "
            "directory or an `llmopt quantize` output"
        )
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
        return "gguf", path
    raise UsageError(
        f"cannot load {path}: not a GGUF file (magic bytes {magic!r}); pass a .gguf file, a HF "
        "directory or a packaged model name"
    )


def load_model(
    spec: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """The model named or located by `spec`, in eval mode, with weights in `dtype` on `device`;
    weights holding NaN/inf are refused (`llmopt.models.finite`).

    `dtype="auto"` keeps weights as the file holds them: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K
    tensors stay packed (`llmopt.models.packed`: the same bytes llama.cpp reads, served by the
    fused CPU kernels; the eager forward dequantizes on the fly), its other tensors fp32; other
    sources load as float32. What serving and generation use. A torch dtype (the default
    float32) dequantizes everything: what training, quantization and evaluation need.
    """
    if isinstance(dtype, str):
        if dtype != "auto":
            raise UsageError(f"dtype={dtype!r}; pass a torch dtype or 'auto'")
        kind, path = resolve_spec(spec)
        if kind == "gguf":
            from llmopt.models.gguf import open_gguf
            from llmopt.models.packed import packed_gguf_modules

            gguf_file = open_gguf(path)
            config = gguf_file.config()
            modules = packed_gguf_modules(gguf_file, config)
            tensors = gguf_file.state_dict(config, torch.float32, skip=set(modules))
            model = model_from_tensors(
                config, tensors, device=device, source=str(path), modules=modules
            )
            check_finite_weights(model, str(spec))
            return model
        dtype = torch.float32
    model = _load_model(spec, dtype=dtype, device=device)
    check_finite_weights(model, str(spec))
    return model


def load_config(spec: str | Path) -> ModelConfig | None:
    """The model config of `spec` without loading its weights (a GGUF's metadata, an HF
    directory's config.json, a compressed directory's marker); None for a format that keeps
    it elsewhere. What resource checks (KV cache size, layouts) read before any work."""
    kind, path = resolve_spec(spec)
    if kind == "gguf":
        from llmopt.models.gguf import open_gguf

        return open_gguf(path).config()
    if kind == "hf":
        from llmopt.models.hf import read_config

        return read_config(path)
    marker = path / get_directory_format(kind).marker  # every format's marker holds the config
    data = read_json(marker, "marker").get("model_config")
    return ModelConfig.from_dict(data) if isinstance(data, dict) else None


def _load_model(spec: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    kind, path = resolve_spec(spec)
    if kind not in ("gguf", "hf"):
        return get_directory_format(kind).load(path, dtype=dtype, device=device)
    if kind == "gguf":
        from llmopt.models.gguf import open_gguf

        gguf_file = open_gguf(path)
        config = gguf_file.config()
        tensors = gguf_file.state_dict(config, dtype)
    else:
        from llmopt.models.hf import (
            drop_rotary_buffers,
            from_hf_layout,
            iter_tensors,
            quant_method,
            read_config,
        )

        method = quant_method(path)
        if method is not None:  # AWQ/GPTQ checkpoints: packed tensors, not plain weights
            return quantization_loader(method)(path, dtype=dtype, device=device)
        config = read_config(path)
        tensors = from_hf_layout(
            drop_rotary_buffers(iter_tensors(path, dtype), config, str(path)), config
        )
    return model_from_tensors(config, tensors, device=device, source=str(path))


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer that belongs to a model spec (GGUF metadata or `tokenizer.json`)."""
    kind, path = resolve_spec(spec)
    if kind == "gguf":
        from llmopt.models.gguf import open_gguf

        gguf_file = open_gguf(path)
        keys = [k for k in gguf_file.reader.fields if k.startswith("tokenizer.")]
        if "tokenizer.ggml.tokens" not in keys:
            raise GGUFError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens metadata)")
        return Tokenizer.from_gguf_metadata({k: gguf_file.field(k) for k in keys})
    return Tokenizer.from_directory(path)


def save_pretrained(
    model: Transformer, directory: str | Path, tokenizer: Tokenizer | None = None
) -> Path:
    """Write a HF-style directory (config.json, model.safetensors, tokenizer files).

    Each file is written to a temporary name and renamed, so an interrupted save never leaves
    a half-written file under the final name.
    """
    from llmopt.models.hf import save_directory

    directory = Path(directory)
    save_directory(model, directory)
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
