"""GGUF files (llama.cpp's format) -> `ModelConfig`, a PyTorch state dict and a tokenizer.

Reading and dequantisation go through the `gguf` package (vectorised numpy for every type it
supports); this module only maps llama.cpp names and conventions onto ours:
- tensor names (`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`),
- llama.cpp's converter permutes the rows of Llama-architecture Q/K projections so that its
  RoPE kernel can rotate adjacent pairs; we use HF's "rotate half" layout and undo it here
  (Qwen2 files are written unpermuted and are left alone),
- the tokenizer (vocabulary, merges, special tokens, chat template) lives in the metadata.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmopt.errors import LlmoptError
from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.spec import ModelSpec, UnknownArchitectureError, spec_for_gguf

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
}


class GGUFError(LlmoptError, ValueError):
    """A GGUF file that cannot be read or does not describe a supported model."""


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed GGUF file, reused while the file is unchanged (model and tokenizer share it)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


class GGUFFile:
    """An opened GGUF file: metadata fields, tensors, and the mapping to our model."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader  # imported here: `import llmopt.models` stays light

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise GGUFError(
                f"{self.path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')"
            )
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # the reader raises many types on damaged files
            raise GGUFError(f"{self.path} is truncated or corrupted: {exc}") from exc
        self.tensors = {t.name: t for t in self.reader.tensors}
        for tensor in self.tensors.values():
            if tensor.data.size * tensor.data.itemsize != tensor.n_bytes:
                raise GGUFError(
                    f"{self.path} is truncated or corrupted: tensor {tensor.name!r} has "
                    f"{tensor.data.size * tensor.data.itemsize} of its {tensor.n_bytes} bytes"
                )

    # ---- metadata ----
    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise GGUFError(f"{self.path} lacks the metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        """`general.architecture` (the prefix of the shape metadata keys)."""
        self.spec  # noqa: B018 - validates
        return self.require("general.architecture")

    @property
    def spec(self) -> ModelSpec:
        arch = self.require("general.architecture")
        try:
            return spec_for_gguf(arch)
        except UnknownArchitectureError as exc:
            raise GGUFError(f"{exc} (in {self.path})") from None

    def config(self) -> ModelConfig:
        """The model's shapes from `<arch>.*` metadata; tying and biases from the tensor list."""
        arch = self.architecture
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise GGUFError(f"{self.path} has no token_embd.weight tensor")
        num_heads = int(self.require(f"{arch}.attention.head_count"))
        hidden = int(self.require(f"{arch}.embedding_length"))
        head_dim = self.field(f"{arch}.attention.key_length") or self.field(
            f"{arch}.rope.dimension_count"
        )
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self.field(f"{arch}.vocab_size") or int(embed.shape[-1])
        if tokens is not None and vocab != len(tokens.data):
            raise GGUFError(
                f"{self.path}: vocab_size {vocab} != {len(tokens.data)} tokenizer tokens"
            )
        theta = _f32(self.field(f"{arch}.rope.freq_base", 10000.0))
        rope_dim = int(head_dim) if head_dim else hidden // num_heads
        scaling = None
        if "rope_freqs.weight" in self.tensors:
            orig = self.field(f"{arch}.rope.scaling.original_context_length") or 8192
            factors = self.dequantized("rope_freqs.weight").astype(np.float64).reshape(-1)
            scaling = llama3_scaling_from_factors(factors, theta, rope_dim, int(orig), self.path)
        try:
            return ModelConfig(
                name=str(self.field("general.name", self.path.stem)),
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(self.require(f"{arch}.feed_forward_length")),
                num_layers=int(self.require(f"{arch}.block_count")),
                num_heads=num_heads,
                num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", num_heads)),
                max_seq_len=int(self.field(f"{arch}.context_length", 4096)),
                head_dim=int(head_dim) if head_dim and head_dim != hidden // num_heads else None,
                rope_theta=theta,
                rope_scaling=scaling,
                rms_norm_eps=_f32(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                tie_embeddings="output.weight" not in self.tensors,
                attention_bias="blk.0.attn_q.bias" in self.tensors,
                bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
                eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
                architecture=self.spec.architecture,
                sliding_window=self._sliding_window(arch),
            )
        except ConfigError as exc:
            raise GGUFError(f"{self.path}: {exc}") from exc

    def _sliding_window(self, arch: str) -> int | None:
        window = self.field(f"{arch}.attention.sliding_window")
        return int(window) if window and self.spec.sliding_window else None

    # ---- tensors ----
    def our_name(self, gguf_name: str) -> str:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
            return f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
        raise GGUFError(f"{self.path}: unexpected tensor {gguf_name!r} for a Llama-family model")

    def dequantized(self, name: str) -> np.ndarray:
        """A tensor as float32 numpy in PyTorch's [out, in] order (GGUF lists dims reversed)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        kind = tensor.tensor_type
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if kind == GGMLQuantizationType.F32:
            array = np.array(tensor.data, dtype=np.float32)  # a copy: the file is mapped read-only
        elif kind == GGMLQuantizationType.F16:
            array = np.asarray(tensor.data).astype(np.float32)
        else:
            try:
                array = dequantize(tensor.data, kind)
            except NotImplementedError as exc:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} uses {kind.name}, which the installed gguf "
                    f"package cannot dequantise ({exc})"
                ) from exc
        return array.reshape(shape)

    def state_dict(
        self, config: ModelConfig, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor) pairs, Q/K rows un-permuted where llama.cpp permuted them."""
        permuted = self.spec.gguf_permuted_qk
        for gguf_name in self.tensors:
            if gguf_name == "rope_freqs.weight":  # read into config.rope_scaling
                continue
            name = self.our_name(gguf_name)
            array = self.dequantized(gguf_name)
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = unpermute_rope_rows(array, config.num_heads)
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = unpermute_rope_rows(array, config.num_kv_heads)
            yield name, torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, orig_ctx: int, path: Path
) -> dict[str, Any] | None:
    """Llama 3's `rope_scaling` recovered from llama.cpp's per-frequency divisors.

    llama.cpp stores 1 (short wavelengths), `factor` (long ones) and 1/((1-s)/factor + s) in
    between, s linear in 1/wavelength. Only orig_ctx/low and orig_ctx/high enter the math, so
    with the original context (8192 when the file omits it) the fit is exact; factors of any
    other shape are refused rather than approximated.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape or not np.isfinite(factors).all() or factors.min() <= 0:
        raise GGUFError(
            f"{path}: rope_freqs.weight has shape {factors.shape} (need {inv_freq.shape}) or "
            "non-positive/non-finite values"
        )
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    x = orig_ctx * inv_freq / (2 * math.pi)  # orig_ctx / wavelength
    if mid.sum() < 2:
        raise GGUFError(
            f"{path}: rope_freqs.weight has {int(mid.sum())} transition frequencies; llmopt "
            "recovers Llama 3 scaling from 2 or more"
        )
    slope, intercept = np.polyfit(x[mid], smooth[mid], 1)
    low = round(float(-intercept / slope), 6)  # float32 factors: 6 digits are exact
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": low,
        "high_freq_factor": round(low + float(1 / slope), 6),
        "original_max_position_embeddings": orig_ctx,
    }
    wavelen = 2 * math.pi / inv_freq
    expect = np.where(wavelen < orig_ctx / scaling["high_freq_factor"], 1.0, factor)
    between = (wavelen >= orig_ctx / scaling["high_freq_factor"]) & (wavelen <= orig_ctx / low)
    s = (orig_ctx / wavelen - low) / (scaling["high_freq_factor"] - low)
    expect = np.where(between, 1 / ((1 - s) / factor + s), expect)
    if not np.allclose(expect, factors, rtol=1e-4, atol=0):
        raise GGUFError(f"{path}: rope_freqs.weight does not follow Llama 3's RoPE scaling")
    return scaling


def _f32(value: float) -> float:
    """GGUF stores float32: read 1e-5 back as 1e-5, not 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    Within each head, llama.cpp stores rows as interleaved pairs (r0, r_{d/2}, r1, r_{d/2+1},
    ...) so that RoPE rotates adjacent elements; HF's layout rotates the two halves. The
    converter reshaped rows to [heads, 2, d/2] and swapped the last two axes; we swap back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of `unpermute_rope_rows`); for writers."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
