"""The routed experts of a MoE block and their grouped GEMM.

Each expert is a plain gated MLP (`llmopt.models.layers.MLP`: gate_proj, up_proj, down_proj
as `nn.Linear`), so everything that swaps or wraps linears (tensor parallelism, FP8, LoRA,
RTN/AWQ/GPTQ quantization) treats an expert's linears like any other. The container is keyed
by the *global* expert index, so a rank holding a subset (expert parallelism) keeps the
single-model parameter names (`mlp.experts.5.gate_proj.weight`).

The tokens arrive sorted by expert with `counts[i]` rows for the i-th held expert. When every
held linear is a plain, hook-free `nn.Linear`, the experts run as three grouped GEMMs
(`torch.nn.functional.grouped_mm` over the stacked weights: one kernel per projection instead
of one per expert; torch >= 2.8); otherwise (quantized, FP8 or adapter linears, calibration
hooks, older torch) one expert at a time. Every held expert runs, also on zero tokens, so each
of its weights gets a (zero) gradient in every backward: gradient buckets and ZeRO's
reductions then see the same parameters every micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.config import ModelConfig
from llmopt.models.layers import MLP
from llmopt.models.spec import get_spec

_GROUPED_MM = getattr(F, "grouped_mm", None)
_GROUPED_DTYPES = (torch.float32, torch.bfloat16)


class Experts(nn.ModuleDict):
    """The routed experts this module holds, keyed by global index (in increasing order)."""

    def __init__(self, config: ModelConfig, width: int, indices: Iterable[int]) -> None:
        expert = config.replace(intermediate_size=width)
        super().__init__({str(i): MLP(expert) for i in indices})
        self.gelu_gate = get_spec(config.architecture).gate_activation == "gelu_tanh"

    @property
    def indices(self) -> list[int]:
        return [int(k) for k in self.keys()]

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x [M, H] sorted by held expert (counts[i] rows each) -> [M, H]."""
        experts = list(self.values())
        if len(counts) != len(experts) or sum(counts) != x.shape[0]:
            raise ValueError(
                f"{x.shape[0]} tokens in {list(counts)} per expert for {len(experts)} experts"
            )
        if self._grouped(experts, x):
            return self._grouped_forward(experts, x, counts)
        return torch.cat([e(chunk) for e, chunk in zip(experts, x.split(list(counts)))])

    def _grouped(self, experts: list[nn.Module], x: torch.Tensor) -> bool:
        if _GROUPED_MM is None or x.dtype not in _GROUPED_DTYPES:
            return False
        for e in experts:
            if getattr(e, "kind", None) != "swiglu" or e._forward_hooks or e._forward_pre_hooks:
                return False
            for lin in (e.gate_proj, e.up_proj, e.down_proj):
                if type(lin) is not nn.Linear or lin.bias is not None:
                    return False
                if lin._forward_hooks or lin._forward_pre_hooks or lin.weight.dtype != x.dtype:
                    return False
        return True

    def _grouped_forward(
        self, experts: list[nn.Module], x: torch.Tensor, counts: Sequence[int]
    ) -> torch.Tensor:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)

        def gemm(inp: torch.Tensor, name: str) -> torch.Tensor:
            w = torch.stack([getattr(e, name).weight for e in experts])  # [E, out, in]
            return _GROUPED_MM(inp, w.transpose(1, 2), offs=offs)

        gate = gemm(x, "gate_proj")
        act = F.gelu(gate, approximate="tanh") if self.gelu_gate else F.silu(gate)
        return _contiguous_grad(gemm(act * gemm(x, "up_proj"), "down_proj"))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands grouped_mm a contiguous gradient (it refuses expanded
    ones, e.g. the gradient of a plain `.sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x
