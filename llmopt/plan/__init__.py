"""llmopt.plan: choose and explain the parallel mapping of an LLM on a GPU cluster.

Pure, analytical functions from a fully specified configuration to per-rank memory
(`memory.memory_breakdown`), collectives per process group (`comm.collectives_for`), step time
(`timing.step_time`), and a vectorised search over mappings (`search.search`). No GPU needed.
"""

from llmopt.plan.comm import collectives_for, summarize
from llmopt.plan.hardware import Cluster, GPUProfile, LinkProfile, get_cluster
from llmopt.plan.memory import memory_breakdown, model_state_bytes
from llmopt.plan.search import Plan, estimate, search
from llmopt.plan.timing import step_time
from llmopt.plan.workload import ParallelConfig, Workload

__all__ = [
    "Cluster",
    "GPUProfile",
    "LinkProfile",
    "ParallelConfig",
    "Plan",
    "Workload",
    "collectives_for",
    "estimate",
    "get_cluster",
    "memory_breakdown",
    "model_state_bytes",
    "search",
    "step_time",
    "summarize",
]
