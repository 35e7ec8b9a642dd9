"""What every exporter translates: one evaluated plan of one job on one cluster, and the
error an exporter raises for what its framework cannot express."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.hardware import Cluster
from llmopt.plan.search import Plan
from llmopt.plan.workload import Workload


class EmitError(LlmoptError, ValueError):
    """The plan uses something the target framework cannot express; the message says what."""


@dataclass(frozen=True)
class PlannedRun:
    """A ranked plan with everything needed to launch it.

    `model_name` is what the user named (a preset, or a config path); `model_overrides` are
    the shape fields given on the command line (the trainer's names: num_layers, ...).
    """

    model: ModelConfig
    model_name: str
    work: Workload
    cluster: Cluster
    plan: Plan
    model_overrides: dict[str, int] = field(default_factory=dict)

    @property
    def parallel(self) -> ParallelPlan:
        return self.plan.parallel


@dataclass(frozen=True)
class Emitted:
    """An exporter's output: the main document and side files (suffix -> text), e.g. a
    DeepSpeed launcher line next to its JSON config."""

    text: str
    side_files: dict[str, str] = field(default_factory=dict)


def refuse(framework: str, what: str, fix: str) -> EmitError:
    return EmitError(f"{framework} cannot express {what}; {fix}")
