"""The rank grid: how a world of processes is split into tensor, context, data and pipeline
parallel groups.

Rank layout (TP innermost, PP outermost, as Megatron's default "tp-cp-dp-pp" order)::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so a TP group is `tp` consecutive ranks (one node, the fast links) and pipeline stages are the
farthest apart (across nodes, where only point-to-point traffic flows). Gradients of the dense
weights are reduced over the `dp_cp` group (dp x cp ranks: context-parallel ranks hold the same
weights and see different tokens); its counter name is "dp", as the planner's.

Experts (Megatron-Core's "MoE parallel folding", what `llmopt.plan.experts` prices) are laid
over the same tp x cp x dp ranks of a stage, refolded as etp (fastest) x ep x edp: with
i = (dp_index * cp + cp_index) * tp + tp_index, a rank's expert-TP index is i % etp, its EP
index (i // etp) % ep and its expert-data-parallel index i // (etp * ep). `etp` is 1 or tp
(None: tp, Megatron's default): with etp = tp the expert-TP group is the TP group and the EP
group spans cp x dp; with etp = 1 the EP group spans the TP ranks first. Expert gradients are
reduced over `edp` (tp * cp * dp / (etp * ep) ranks).

Every process group is created once, here, with a timeout (so a dead peer raises instead of
hanging) and the `RankGrid` is passed explicitly to whatever needs a group: no module globals.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmopt.models.config import ModelConfig
from llmopt.parallel.comm import CommCounter, Group
from llmopt.parallel.plan import ParallelPlan

DIMS = ("tp", "cp", "dp", "pp")  # innermost first
EXPERT_DIMS = ("etp", "ep", "edp")  # innermost first, within a pipeline stage
GROUPS = (*DIMS, "dp_cp", "tp_cp", "stage", *EXPERT_DIMS)
COUNTED_AS = {"dp_cp": "dp"}  # the planner's name for the dense gradient group
DEFAULT_TIMEOUT_S = 120.0


def tp_split_sizes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(name, size) of every dimension tensor parallelism splits (experts' widths included)."""
    sizes = [
        ("num_heads", cfg.num_heads),
        ("num_kv_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ]
    if cfg.moe is not None:
        sizes.append(("expert_ffn_hidden", cfg.moe.expert_ffn_hidden))
        if cfg.moe.shared_experts:
            sizes.append(("shared expert width", cfg.moe.shared_experts * cfg.moe.shared_hidden))
    return sizes


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism. `dp=-1` means "whatever is left of world_size"."""

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1
    expert_tp: int | None = None  # 1 or tp; None: tp

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)
        if self.expert_tp not in (1, self.tp):
            raise ValueError(f"expert_tp={self.expert_tp!r} must be 1 or tp={self.tp}")
        if self.dp == -1:
            other = self.tp * self.pp * self.cp
            if self.world_size % other:
                raise ValueError(
                    f"tp*pp*cp={other} (tp={self.tp}, pp={self.pp}, cp={self.cp}) does not "
                    f"divide world_size={self.world_size}"
                )
            object.__setattr__(self, "dp", self.world_size // other)
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp={self.dp!r} must be a positive integer (or -1 for auto)")
        product = self.tp * self.pp * self.dp * self.cp
        if product != self.world_size:
            raise ValueError(
                f"tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = {product} "
                f"does not equal world_size={self.world_size}"
            )
        stage = self.tp * self.cp * self.dp
        if stage % (self.expert_tp * self.ep):
            raise ValueError(
                f"expert_tp*ep = {self.expert_tp}*{self.ep} does not divide the "
                f"tp*cp*dp = {stage} ranks of a pipeline stage"
            )

    @classmethod
    def of_plan(cls, plan: ParallelPlan) -> ParallelDims:
        """The grid a ParallelPlan runs on (world = tp * pp * dp * cp)."""
        return cls(
            plan.world_size,
            tp=plan.tp,
            pp=plan.pp,
            dp=plan.dp,
            cp=plan.cp,
            ep=plan.ep,
            expert_tp=plan.resolved_expert_tp,
        )

    @property
    def edp(self) -> int:
        """Ranks each expert is replicated over (its gradients are reduced over these)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """{"etp": i, "ep": j, "edp": k} of a global rank (module docstring)."""
        c = self.coords(rank)
        i = (c["dp"] * self.cp + c["cp"]) * self.tp + c["tp"]
        etp, ep = self.expert_tp, self.ep
        return {"etp": i % etp, "ep": (i // etp) % ep, "edp": i // (etp * ep)}

    def size(self, dim: str) -> int:
        if dim not in DIMS:
            raise ValueError(f"unknown parallel dimension {dim!r}; known: {', '.join(DIMS)}")
        return getattr(self, dim)

    def coords(self, rank: int) -> dict[str, int]:
        """{"tp": i, "cp": j, "dp": k, "pp": l} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size={self.world_size}")
        out = {}
        for dim in DIMS:
            out[dim] = rank % self.size(dim)
            rank //= self.size(dim)
        return out

    def rank_of(self, **coords: int) -> int:
        """Global rank of the given coordinates (missing ones are 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown dimensions {sorted(unknown)}; known: {', '.join(DIMS)}")
        rank = 0
        for dim in reversed(DIMS):
            index = coords.get(dim, 0)
            if not 0 <= index < self.size(dim):
                raise ValueError(f"{dim} index {index} is outside {dim}={self.size(dim)}")
            rank = rank * self.size(dim) + index
        return rank

    def group_ranks(self, dim: str) -> list[tuple[int, ...]]:
        """Every group along `dim` (a grid dimension, "dp_cp", "tp_cp", or an expert one:
        "ep", "edp"): the ranks that differ only in those coordinates."""
        spans = {"dp_cp": ("dp", "cp"), "tp_cp": ("tp", "cp"), "stage": ("tp", "cp", "dp")}
        spans = spans.get(dim, (dim,))
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            if dim in EXPERT_DIMS:
                e = self.expert_coords(rank)
                key = (c["pp"], *(e[d] for d in EXPERT_DIMS if d != dim))
            else:
                key = tuple(c[d] for d in DIMS if d not in spans)
            groups.setdefault(key, []).append(rank)
        return [tuple(g) for g in groups.values()]

    def validate_model(
        self, config: ModelConfig, seq_len: int | None = None, sequence_parallel: bool = False
    ) -> None:
        """Raise a ValueError naming the first shape that this layout cannot split."""
        for name, value in tp_split_sizes(config):
            if value % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {name}={value}")
        if self.cp > 1 and seq_len is not None and seq_len % (2 * self.cp):
            raise ValueError(
                f"context parallel: 2*cp={2 * self.cp} does not divide the sequence length "
                f"{seq_len} (the zig-zag split)"
            )
        local = None if seq_len is None else seq_len // self.cp
        if sequence_parallel and local is not None and local % self.tp:
            raise ValueError(
                f"sequence parallel: tp={self.tp} does not divide the sequence length {local}"
                + (f" on each of the cp={self.cp} ranks" if self.cp > 1 else "")
            )
        if self.ep > 1 and config.moe is None:
            raise ValueError(f"ep={self.ep} needs a model with experts; {config.name} is dense")
        if config.moe is not None and config.moe.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide num_experts={config.moe.num_experts}")
        if config.num_layers < self.pp:
            raise ValueError(f"pp={self.pp} exceeds num_layers={config.num_layers}")


@dataclass
class RankGrid:
    """This process's place in the grid and its groups (`tp`, `cp`, `dp`, `pp`, `world`).

    Build with `RankGrid.create(dims)` after `torch.distributed` is initialised (or with
    world_size=1 and no initialisation for a single process). All groups share `counter`.
    """

    dims: ParallelDims
    rank: int
    groups: dict[str, Group]
    counter: CommCounter = field(default_factory=CommCounter)

    @classmethod
    def create(cls, dims: ParallelDims, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGrid:
        counter = CommCounter()
        initialised = dist.is_available() and dist.is_initialized()
        if initialised:
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world, rank = 1, 0
        if world != dims.world_size:
            raise ValueError(
                f"the grid is for world_size={dims.world_size} but {world} processes are running"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        groups: dict[str, Group] = {}
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # one process group per set
        for dim in GROUPS:
            for ranks in dims.group_ranks(dim):
                if ranks not in made:
                    # new_group is collective: every rank creates every group, in one order.
                    made[ranks] = (
                        dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                    )
                if rank in ranks:
                    name = COUNTED_AS.get(dim, dim)
                    groups[dim] = Group(name, ranks, ranks.index(rank), made[ranks], counter)
        world_pg = dist.group.WORLD if initialised and world > 1 else None
        groups["world"] = Group("world", tuple(range(world)), rank, world_pg, counter)
        return cls(dims=dims, rank=rank, groups=groups, counter=counter)

    @classmethod
    def local(cls) -> RankGrid:
        """A one-process grid (every group of size 1), usable even inside a larger job."""
        counter = CommCounter()
        groups = {
            name: Group(COUNTED_AS.get(name, name), (0,), 0, None, counter)
            for name in (*GROUPS, "world")
        }
        return cls(dims=ParallelDims(1), rank=0, groups=groups, counter=counter)

    @property
    def tp(self) -> Group:
        return self.groups["tp"]

    @property
    def cp(self) -> Group:
        return self.groups["cp"]

    @property
    def dp(self) -> Group:
        return self.groups["dp"]

    @property
    def pp(self) -> Group:
        return self.groups["pp"]

    @property
    def dp_cp(self) -> Group:
        """Where dense gradients are reduced (dp x cp ranks; counted as "dp")."""
        return self.groups["dp_cp"]

    @property
    def tp_cp(self) -> Group:
        """The ranks sharing one micro-batch's tokens (uncounted routing statistics)."""
        return self.groups["tp_cp"]

    @property
    def stage(self) -> Group:
        """The tp x cp x dp ranks holding this rank's pipeline stage (FP8 amax reductions)."""
        return self.groups["stage"]

    @property
    def ep(self) -> Group:
        return self.groups["ep"]

    @property
    def edp(self) -> Group:
        return self.groups["edp"]

    @property
    def etp(self) -> Group:
        """Expert tensor parallelism: the TP group when expert_tp = tp, else one rank."""
        return self.tp if self.dims.expert_tp > 1 else self.groups["etp"]

    @property
    def world(self) -> Group:
        return self.groups["world"]

    def describe(self) -> str:
        c = self.dims.coords(self.rank)
        where = f"rank {self.rank} (tp {c['tp']}, cp {c['cp']}, dp {c['dp']}, pp {c['pp']}"
        if self.dims.ep > 1:
            where += f", ep {self.dims.expert_coords(self.rank)['ep']}"
        return where + ")"


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[torch.device, str]:
    """Initialise torch.distributed from torchrun's environment: NCCL+CUDA if present, else
    gloo+CPU. Returns (device, backend). A no-op single process when WORLD_SIZE is unset."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device, backend
