"""llmopt.plan: choose and explain the parallel mapping of an LLM on a GPU cluster.

Pure, analytical functions from a fully specified configuration (a `ParallelPlan`) to per-rank
memory (`memory.memory_breakdown`), collectives per process group (`comm.collectives_for`),
step time (`timing.step_time`), a vectorised search over plans (`search.search`), the exact
bytes one run will move (`predict`), and exporters to other frameworks (`emit`). No GPU, no
torch.
"""

from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.comm import collectives_for, summarize
from llmopt.plan.hardware import Cluster, GPUProfile, LinkProfile, get_cluster
from llmopt.plan.memory import memory_breakdown, model_state_bytes
from llmopt.plan.predict import predicted_activation_bytes, predicted_comm
from llmopt.plan.search import Plan, estimate, search
from llmopt.plan.timing import step_time
from llmopt.plan.workload import Workload

__all__ = [
    "Cluster",
    "GPUProfile",
    "LinkProfile",
    "ParallelPlan",
    "Plan",
    "Workload",
    "collectives_for",
    "estimate",
    "get_cluster",
    "memory_breakdown",
    "model_state_bytes",
    "predicted_activation_bytes",
    "predicted_comm",
    "search",
    "step_time",
    "summarize",
]
