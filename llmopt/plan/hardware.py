"""Where the planner gets its hardware: a named preset cluster (`catalog`), a preset with
fields overridden (`customize`), or a cluster TOML file. Re-exports the profile classes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from llmopt.config_files import INT, STR, TABLE, check_fields, dataclass_schema, read_toml
from llmopt.errors import UsageError
from llmopt.plan.catalog import CLUSTER_ALIASES, CLUSTER_PRESETS
from llmopt.plan.profiles import GIB, Cluster, GPUProfile, LinkProfile

# the top level of a cluster TOML (ours: unknown keys are refused)
CLUSTER_FILE = {
    "base": STR,
    "name": STR,
    "nodes": INT,
    "gpus_per_node": INT,
    "gpu": TABLE,
    "intra_node": TABLE,
    "inter_node": TABLE,
}

__all__ = [
    "CLUSTER_ALIASES",
    "CLUSTER_PRESETS",
    "GIB",
    "Cluster",
    "GPUProfile",
    "LinkProfile",
    "customize",
    "get_cluster",
    "load_cluster_toml",
]


def get_cluster(name: str, nodes: int = 1, gpus_per_node: int | None = None) -> Cluster:
    """A preset cluster of `nodes` nodes (scale-up domains: 8 GPUs, 72 for an NVL72 rack)."""
    key = CLUSTER_ALIASES.get(name.lower(), name.lower())
    if key not in CLUSTER_PRESETS:
        raise UsageError(
            f"unknown cluster {name!r}; known: {', '.join(CLUSTER_PRESETS)} "
            f"(aliases {', '.join(CLUSTER_ALIASES)}) or a TOML file"
        )
    gpu, nvl, net, per_node = CLUSTER_PRESETS[key]
    return Cluster(key, gpu, nodes, gpus_per_node or per_node, nvl, net)


def customize(cluster: Cluster, **overrides: Any) -> Cluster:
    """Override GPU/link fields by name: `gpu.<field>`, `intra_node.<field>`, `inter_node.<field>`,
    or a top-level field (`nodes`, `gpus_per_node`)."""
    gpu, intra, inter = {}, {}, {}
    top: dict[str, Any] = {}
    targets = {"gpu": (gpu, GPUProfile), "intra_node": (intra, LinkProfile)}
    targets["inter_node"] = (inter, LinkProfile)
    for key, value in overrides.items():
        if value is None:
            continue
        part, _, field = key.partition(".")
        if field:
            if part not in targets:
                raise UsageError(f"unknown cluster section {part!r}; valid: {', '.join(targets)}")
            store, cls = targets[part]
            names = {f.name for f in dataclasses.fields(cls)}
            if field not in names:
                raise UsageError(f"unknown {part} field {field!r}; valid: {sorted(names)}")
            store[field] = value
        elif key in ("nodes", "gpus_per_node", "name"):
            top[key] = value
        else:
            raise UsageError(f"unknown cluster field {key!r}")
    changed = {k: v for k, v in gpu.items() if getattr(cluster.gpu, k) != v and k != "name"}
    if changed and "name" not in gpu:  # a modified GPU is no longer the preset it started from
        what = ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items()
        )
        gpu["name"] = f"{cluster.gpu.name} modified ({what})"
    return dataclasses.replace(
        cluster,
        gpu=dataclasses.replace(cluster.gpu, **gpu),
        intra_node=dataclasses.replace(cluster.intra_node, **intra),
        inter_node=dataclasses.replace(cluster.inter_node, **inter),
        **top,
    )


def load_cluster_toml(path: str | Path, nodes: int | None = None) -> Cluster:
    """A cluster from TOML: `base = "dgx-h100"`, `nodes = 8`, and `[gpu]`, `[intra_node]`,
    `[inter_node]` tables overriding any profile field."""
    p = Path(path)
    data = read_toml(p, "cluster file")
    check_fields(str(p), data, CLUSTER_FILE)
    sections = {"gpu": GPUProfile, "intra_node": LinkProfile, "inter_node": LinkProfile}
    for section, cls in sections.items():
        check_fields(f"{p} [{section}]", data.get(section, {}), dataclass_schema(cls))
    try:
        base = get_cluster(data.pop("base", "dgx-h100"))
    except ValueError as exc:
        raise UsageError(f"{p}: base: {exc}") from None
    overrides: dict[str, Any] = {}
    for section in ("gpu", "intra_node", "inter_node"):
        for k, v in dict(data.pop(section, {})).items():
            overrides[f"{section}.{k}"] = v
    overrides.update(data)
    if nodes is not None:
        overrides["nodes"] = nodes
    try:
        return customize(base, **overrides)
    except ValueError as exc:  # a value of the right type the profile refuses: name the file
        raise UsageError(f"{p}: {exc}") from None
