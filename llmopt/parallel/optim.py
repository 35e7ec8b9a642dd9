"""AdamW over the engine's flat fp32 master shards.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, the
single-tensor formulation), written out because it is elementwise and the point of ZeRO is
where its state lives: each rank holds exp_avg/exp_avg_sq only for its master shard.
A second reason: constructing any `torch.optim.Optimizer` imports torch._dynamo, ~6 s per
process on a small CPU — a cost every rank of every launch would pay.
The interface is the subset the trainer and checkpoints use: `param_groups` (lr is set per
step), `state`, `step()`, `zero_grad()`, `state_dict()`, `load_state_dict()`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch


class AdamW:
    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("AdamW got an empty parameter list")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                f"weight_decay={weight_decay}"
            )
        self.param_groups: list[dict[str, Any]] = [
            {
                "params": params,
                "lr": lr,
                "betas": tuple(betas),
                "eps": eps,
                "weight_decay": weight_decay,
            }
        ]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state.get(p)
                if state is None:
                    state = self.state[p] = {
                        "step": 0,
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                state["step"] += 1
                step = state["step"]
                p.mul_(1 - lr * group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: state keyed by parameter index, groups without tensors."""
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index[id(p)] for p in group["params"]]
            groups.append(g)
        state = {
            index[id(p)]: {**s, "step": torch.tensor(float(s["step"]))}
            for p, s in self.state.items()
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = self.param_groups[0]["params"]
        saved = state_dict["param_groups"]
        if len(saved) != 1 or len(saved[0]["params"]) != len(params):
            raise ValueError(
                f"optimizer state has {len(saved[0]['params'])} parameters; this run has "
                f"{len(params)}"
            )
        group = copy.deepcopy({k: v for k, v in saved[0].items() if k != "params"})
        group["betas"] = tuple(group["betas"])
        self.param_groups[0].update(group)
        self.state = {}
        for idx, s in state_dict["state"].items():
            p = params[int(idx)]
            step = s["step"]
            self.state[p] = {
                "step": int(step.item()) if torch.is_tensor(step) else int(step),
                "exp_avg": s["exp_avg"].to(p.device, p.dtype).clone(),
                "exp_avg_sq": s["exp_avg_sq"].to(p.device, p.dtype).clone(),
            }
