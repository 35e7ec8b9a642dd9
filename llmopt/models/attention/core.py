"""The attention math: softmax(QK^T * scale) V for grouped-query attention, one layer's rules.

`AttentionCore` is the only place where scores are formed. Every attention backend (no cache,
static cache, paged cache, ONNX past/present, ring attention) decides *which* keys a query may
see and then calls the core, so sliding windows, Gemma 2's score soft-capping and query
scaling hold on every path by construction. It stays its own module so selective activation
recomputation can wrap exactly it.

Visibility is decided from positions: a key at position p_k is visible to a query at p_q when
p_k <= p_q, p_k >= 0 (a negative position marks padding), the key lies inside the layer's
window (p_k > p_q - window, HF Mistral's convention) and an optional `allowed` mask agrees
(a speculative draft tree, where siblings share a position but must not see each other).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# `enable_gqa` (torch >= 2.5) avoids materialising repeated KV heads.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def visible_keys(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B|1, T, S] bool: which keys each query may attend to (see the module docstring).

    q_pos [B|1, T] and k_pos [B|1, S] are absolute positions; k_pos < 0 is padding.
    """
    qp, kp = q_pos[..., :, None], k_pos[..., None, :]
    visible = (kp <= qp) & (kp >= 0)
    if window is not None:
        visible = visible & (kp > qp - window)
    if allowed is not None:
        visible = visible & allowed
    return visible


class AttentionCore(nn.Module):
    """softmax(QK^T * scale [soft-capped]) V, causal, for grouped-query attention.

    q: [B, H, T, Dk]; k: [B, Hkv, S, Dk]; v: [B, Hkv, S, Dv]. Without positions the T queries
    sit at the last T of the S keys. `window`: query i sees keys (i - window, i]. `scale`
    replaces 1/sqrt(Dk); `softcap` maps scores to cap * tanh(score / cap) before the mask
    (Gemma 2), which SDPA cannot do, so those take the explicit path.
    """

    def __init__(
        self, window: int | None = None, scale: float | None = None, softcap: float | None = None
    ) -> None:
        super().__init__()
        self.window = window
        self.scale = scale
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor | None = None,
        k_pos: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t, s = q.shape[2], k.shape[2]
        if q_pos is None and k_pos is None and allowed is None:
            windowed = self.window is not None and s > self.window
            if self.softcap is None and t == s and not windowed:
                return self._causal(q, k, v)
            if t == 1 and not windowed and self.softcap is None:
                return self._attend(q, k, v, None)  # one query sees every cached key
            device = q.device
            q_pos = torch.arange(s - t, s, device=device)[None]
            k_pos = torch.arange(s, device=device)[None]
        if q_pos is None or k_pos is None:
            raise ValueError("attention positions come in pairs: pass both q_pos and k_pos")
        return self._attend(q, k, v, visible_keys(q_pos, k_pos, self.window, allowed))

    def _causal(self, q, k, v) -> torch.Tensor:
        """Plain causal self-attention over the same T positions (flash/efficient kernels)."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and not _SDPA_HAS_GQA:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        gqa = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **gqa)

    def _attend(self, q, k, v, visible: torch.Tensor | None) -> torch.Tensor:
        """Attention under an explicit [B|1, T, S] visibility mask (None: all keys).

        Each KV head's query group is folded into the query rows, so cached keys are read once
        and never copied per query head.
        """
        batch, heads, t, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        qf = q.reshape(batch, kv_heads, groups * t, q.shape[-1])
        mask = None
        if visible is not None:  # [B|1, T, S] -> [B|1, 1, groups * T, S]
            mask = visible[:, None].repeat(1, 1, groups, 1)
        if self.softcap is not None:
            out = self._capped(qf, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, heads, t, v.shape[-1])

    def _capped(self, qf, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """Soft-capped scores (HF Gemma 2's eager order: scale, cap, mask, fp32 softmax)."""
        scale = self.scale if self.scale is not None else qf.shape[-1] ** -0.5
        scores = torch.matmul(qf, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qf.dtype)
        return torch.matmul(probs, v)
