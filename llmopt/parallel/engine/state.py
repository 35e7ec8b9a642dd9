"""An TrainingEngine's state for checkpoints: this rank's shards as they are, and the whole model's
tensors by single-model name (what resuming in another layout cuts its own shards from).

Full tensors are assembled in three steps, each collective and uncounted: ZeRO shards and TP
shards of this rank's units (`DataParallel.gather_full`), the routed experts of the other EP
ranks (every EP rank holds the same experts' shapes, so one all-gather of a flat vector), and
the other pipeline stages (point-to-point to pp rank 0, names from a weightless model). The
same path serves the fp32 masters, their gradients and the optimizer's moments; trained
buffers (MoE balancing biases) ride with the masters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for
from llmopt.parallel.pipeline.stage import split_model, stage_parameters

BUFFER = "buffer/"  # state_dict() prefix of trained buffers


def persistent_buffers(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Persistent buffers of the stages by single-model name (the trained ones: MoE biases)."""
    out = {}
    for stage in stages:
        for module_name, module in stage.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{module_name}.{name}" if module_name else name] = buf
    return out


class EngineState:
    """Mixin of `TrainingEngine`: layout, shards and full tensors (needs dp, grid, plan, model,
    layers_per_stage, extra_state, device)."""

    def units_layout(self) -> list[list]:
        """This rank's units (name, padded size): its shard's layout, which differs between
        pipeline stages and EP ranks (`layout` is what every rank shares)."""
        return [[u.name, u.padded] for u in self.dp.units]

    def layout(self) -> dict[str, Any]:
        """What must match for a checkpoint to restore the ranks' shards as they are."""
        d = self.grid.dims
        return {
            "tp": d.tp,
            "pp": d.pp,
            "dp": d.dp,
            "cp": d.cp,
            "ep": d.ep,
            "expert_tp": d.expert_tp,
            "zero": self.dp.zero,
            "param_dtype": str(self.dp.param_dtype),
            "layers_per_stage": list(self.layers_per_stage or []),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 masters (full or ZeRO shard) by unit name, and its trained
        buffers (MoE balancing biases) under `buffer/<name>`."""
        state = {u.name: u.master.detach() for u in self.dp.units}
        state.update({f"{BUFFER}{n}": b.detach() for n, b in self.extra_state.items()})
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore this rank's masters (from `state_dict()` or `local_from_full`)."""
        for unit in self.dp.units:
            if unit.name not in state:
                raise KeyError(f"the state lacks unit {unit.name!r}")
            unit.master.copy_(state[unit.name])
        for name, buf in self.extra_state.items():
            if f"{BUFFER}{name}" not in state:
                raise KeyError(f"the state lacks buffer {name!r}")
            buf.copy_(state[f"{BUFFER}{name}"])
        self.update_params()

    def local_from_full(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's per-unit pieces (by unit name), and its buffers if `full` has them,
        cut from full tensors by name: how any layout's full state loads into this one."""
        pieces = self.dp.local_from_full(full)
        out = {u.name: t for u, t in zip(self.dp.units, pieces)}
        for name in self.extra_state:
            if name in full:
                out[f"{BUFFER}{name}"] = full[name]
        return out

    # ---- full tensors ----
    def gather_full(self, locals_: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Full tensors of this rank's pipeline stage by single-model name, from one tensor
        per unit in the master's layout (masters, gradients, optimizer moments). Collective
        over the world; not counted."""
        return self._with_all_experts(self.dp.gather_full(locals_))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """This stage's reduced gradients, full (ZeRO-, TP- and EP-gathered). Collective."""
        return self.gather_full([u.master.grad for u in self.dp.units])

    def full_params(self) -> dict[str, torch.Tensor]:
        """This stage's fp32 parameters and trained buffers, full. Collective."""
        out = self.gather_full([u.master.detach() for u in self.dp.units])
        out.update({n: b.detach().float().clone() for n, b in self.extra_state.items()})
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state (single-model names, loadable into `Transformer`) on
        pp rank 0 of every rank coordinate; {} on the other pp ranks. Collective, uncounted.
        A tied weight appears under both names, as `Transformer.state_dict()` lists it."""
        out = self.to_first_stage(self.full_params(), buffers=True)
        config = self.model.config
        if out and config.tie_embeddings:
            spec = spec_for(self.model)
            out.setdefault(f"{spec.head}.weight", out[f"{spec.embedding}.weight"])
        return out

    @torch.no_grad()
    def to_first_stage(
        self, local: dict[str, torch.Tensor], buffers: bool = False
    ) -> dict[str, torch.Tensor]:
        """Every stage's full tensors (`gather_full` output, + buffers) on pp rank 0; {}
        elsewhere. Collective over PP; not counted."""
        pp = self.grid.pp
        if pp.size == 1:
            return local
        with self.grid.counter.paused():  # sends go from the parameters' device (NCCL)
            if pp.rank != 0:
                names = self._flat_names(pp.rank, buffers)
                flat = torch.cat([local[n].reshape(-1).float() for n, _ in names])
                pp.batch_p2p([("send", flat, 0)], wait=True)
                return {}
            out = dict(local)
            for rank in range(1, pp.size):
                names = self._flat_names(rank, buffers)
                flat = torch.empty(sum(s.numel() for _, s in names), device=self.device)
                pp.batch_p2p([("recv", flat, rank)], wait=True)
                offset = 0
                for name, shape in names:
                    out[name] = flat[offset : offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
        return out

    def _flat_names(self, pp_rank: int, buffers: bool) -> list[tuple[str, torch.Size]]:
        """(name, full shape) of a pp rank's parameters (and persistent buffers), in a fixed
        order (a weightless model)."""
        with torch.device("meta"):
            meta = Transformer(self.model.config)
        stages = split_model(
            meta, pp_rank, self.grid.pp.size, self.plan.virtual_stages, self.layers_per_stage
        )
        names = [(n, p.shape) for n, p in stage_parameters(stages).items()]
        if buffers:
            names += [(n, b.shape) for n, b in persistent_buffers(stages).items()]
        return names

    @torch.no_grad()
    def _with_all_experts(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`local` plus the routed experts the other EP ranks hold (uncounted all-gather)."""
        ep = self.grid.ep
        config = self.model.config
        if ep.size == 1 or config.moe is None:
            return local
        marker = re.escape(spec_for(self.model).experts) + r"\.(\d+)\."
        per = config.moe.num_experts // ep.size

        def renumbered(name: str, rank: int) -> str:
            """`name` (one of this rank's experts) for the same local expert of `rank`."""

            def move(m: re.Match) -> str:
                index = int(m.group(1)) - ep.rank * per + rank * per
                return m.group(0).replace(m.group(1), str(index))

            return re.sub(marker, move, name, count=1)

        # one order on every EP rank: by the name each would give the same local expert on 0
        mine = sorted((n for n in local if re.search(marker, n)), key=lambda n: renumbered(n, 0))
        flat = torch.cat([local[n].reshape(-1).float() for n in mine])
        every = torch.empty(ep.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        with self.grid.counter.paused():
            ep.all_gather_into(every, flat)
        out = dict(local)
        for rank, chunk in enumerate(every.chunk(ep.size)):
            offset = 0
            for name in mine:
                shape = local[name].shape
                piece = chunk[offset : offset + shape.numel()].view(shape)
                out[renumbered(name, rank)] = piece.to(local[name].dtype).clone()
                offset += shape.numel()
        return out
