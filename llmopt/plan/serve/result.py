"""The planner's answer for one serving deployment (what `llmopt plan serve` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.plan.serve.capacity import Capacity
from llmopt.plan.serve.scenario import Scenario
from llmopt.plan.serve.simulate import Simulated
from llmopt.plan.serve.step import StepCost


@dataclass(frozen=True)
class ServeEstimate:
    """Predicted steady state of a deployment of `replicas` identical replicas."""

    model: str
    gpu: str
    scenario: Scenario
    capacity: Capacity
    batch: float  # running sequences per replica
    itl_s: float  # between two output tokens of a request (TPOT; at a rate, median streamed gap)
    ttft_s: float | None  # None offline (it is the queue's length, not the system's)
    output_tokens_per_s: float  # whole deployment
    request_rate: float  # completed requests/s, whole deployment
    step: StepCost
    bound: str
    explanation: list[str] = field(default_factory=list)
    overloaded: bool = False
    simulation: Simulated | None = None  # at a request rate: the replayed benchmark

    @property
    def num_gpus(self) -> int:
        return self.scenario.replicas * self.scenario.tp

    def to_dict(self) -> dict:
        sc = self.scenario
        return {
            "model": self.model,
            "gpu": self.gpu,
            "tp": sc.tp,
            "ep": sc.ep,
            "replicas": sc.replicas,
            "num_gpus": self.num_gpus,
            "precision": sc.precision,
            "kv_dtype": sc.kv_dtype,
            "input_len": sc.input_len,
            "output_len": sc.output_len,
            "load": str(sc.load),
            "capacity": self.capacity.to_dict(),
            "batch_per_replica": self.batch,
            "itl_ms": self.itl_s * 1e3,
            "ttft_ms": None if self.ttft_s is None or self.overloaded else self.ttft_s * 1e3,
            "output_tokens_per_s": self.output_tokens_per_s,
            "output_tokens_per_s_per_gpu": self.output_tokens_per_s / self.num_gpus,
            "request_rate": self.request_rate,
            "step_ms": {k: v * 1e3 for k, v in vars(self.step).items()},
            "bound": self.bound,
            "overloaded": self.overloaded,
            "explanation": self.explanation,
            "simulation": None if self.simulation is None else self.simulation.to_dict(),
        }
