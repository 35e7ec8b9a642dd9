"""`--objective gpus`: the smallest slice of the cluster that runs the job (whole nodes, or
part of one node), then its fastest plan. Each size is a full search, smallest first."""

from __future__ import annotations

import dataclasses

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster
from llmopt.plan.objectives import Requirement
from llmopt.plan.search import SearchResult, search
from llmopt.plan.workload import Workload


def cluster_sizes(cluster: Cluster) -> list[Cluster]:
    """Candidate slices, fewest GPUs first: 1, 2, 4... GPUs of one node, then 2..N nodes."""
    g = cluster.gpus_per_node
    one = [
        dataclasses.replace(cluster, nodes=1, gpus_per_node=d)
        for d in range(1, g + 1)
        if g % d == 0
    ]
    return one + [cluster.with_nodes(n) for n in range(2, cluster.nodes + 1)]


def search_fewest_gpus(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    top_k: int = 10,
    constraints: dict[str, int] | None = None,
    framework: str = "llmopt",
    requires: tuple[Requirement, ...] = (),
) -> tuple[Cluster, SearchResult]:
    """The smallest slice with a valid plan and its ranking by step time; when even the whole
    cluster has none, the whole cluster's one-line error."""
    for size in cluster_sizes(cluster):
        try:
            return size, search(model, work, size, top_k, constraints, framework, "time", requires)
        except ValueError:
            if size.num_gpus == cluster.num_gpus:
                raise
    raise AssertionError("unreachable: the last size is the whole cluster")
