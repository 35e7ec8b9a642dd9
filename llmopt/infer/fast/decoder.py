"""`FastDecoder`: prefill with the eager model, then one C++ call per decoded token.

Prefill stays in PyTorch (a [1, T] forward is matmul-bound and torch's GEMMs are good); its
keys/values are copied once into the decoder's fp32 static cache. Each decode step is then a
single call into decode.cpp: no per-op dispatch, fused QKV and gate/up GEMVs, and batch-1
kernels for fp32/bf16/INT8/INT4 weights.

Kernel layouts are built once per model (and rebuilt if any parameter is replaced or edited in
place); a decoder is cheap to create per generation, since it only allocates the cache.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.infer.fast.build import build_error, load_kernels
from llmopt.infer.fast.layout import KernelWeight, decoder_weights, weight_bytes_per_token


class KernelsUnavailableError(LlmoptError, RuntimeError):
    """The C++ decode kernels could not be built on this machine."""


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(model: nn.Module) -> tuple:
    tensors = list(model.parameters()) + list(model.buffers())
    return tuple((t.data_ptr(), t.dtype, t._version) for t in tensors)


def _to_cpp(kmod: Any, w: KernelWeight) -> Any:
    none = torch.empty(0)
    scales = none if w.scales is None else w.scales
    zs = none if w.zs is None else w.zs
    return kmod.make_linear(w.kind, w.w, scales, zs, w.bias, w.group)


def prepare_layout(model: nn.Module, int8_head: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(python weights, C++ linears) for `model`, cached while its parameters are unchanged."""
    kmod = load_kernels()
    if kmod is None:
        raise KernelsUnavailableError(f"fast decode kernels unavailable: {build_error()}")
    key = (_fingerprint(model), int8_head)
    cached = _LAYOUTS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    weights = decoder_weights(model, int8_head=int8_head)
    layers = weights["layers"]
    cpp = {
        name: [_to_cpp(kmod, w) for w in layers[name]] for name in ("qkv", "o", "gate_up", "down")
    }
    cpp["head"] = _to_cpp(kmod, weights["head"])
    _LAYOUTS[model] = (key, weights, cpp)
    return weights, cpp


class FastDecoder:
    """Static-cache batch-1 decoder over `model`'s weights for up to `max_len` positions."""

    def __init__(self, model: nn.Module, max_len: int, *, int8_head: bool = False) -> None:
        cfg = model.config
        if not 0 < max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
        self.model = model
        self.int8_head = int8_head
        weights, cpp = prepare_layout(model, int8_head)
        self.bytes_per_token = weight_bytes_per_token(weights)
        self.kinds = sorted(
            {w.kind for key in ("qkv", "o", "gate_up", "down") for w in weights["layers"][key]}
        )
        rotary = model.rotary
        self._cpp = load_kernels().Decoder(
            weights["heads"],
            weights["kv_heads"],
            weights["head_dim"],
            max_len,
            weights["eps"],
            weights["embed"],
            weights["layers"]["in"],
            weights["layers"]["post"],
            weights["final_norm"],
            cpp["qkv"],
            cpp["o"],
            cpp["gate_up"],
            cpp["down"],
            cpp["head"],
            rotary.cos,
            rotary.sin,
        )
        self.max_len = max_len
        self.length = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [vocab] after the prompt (eager forward), its keys/values cached."""
        from llmopt.models.llama import KVCache

        n = len(prompt_ids)
        if not 0 < n < self.max_len:
            raise ValueError(f"prompt of {n} tokens must be in [1, {self.max_len - 1}]")
        param = next(self.model.parameters())
        cache = KVCache.for_model(self.model, batch_size=1, max_len=n)
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)
        logits = self.model(tokens, cache, last_only=True)[0, -1].float()
        self._cpp.k_cache[:, :, :n].copy_(cache.k[:, 0, :, :n])
        self._cpp.v_cache[:, :, :n].copy_(cache.v[:, 0, :, :n])
        self.length = n
        return logits

    def step(self, token: int) -> torch.Tensor:
        """Logits [vocab] after `token` (fp32; a buffer the next step overwrites)."""
        if self.length >= self.max_len:
            raise ValueError(f"decoder cache full: {self.length} of {self.max_len} positions")
        logits = self._cpp.step(int(token), self.length)
        self.length += 1
        return logits
