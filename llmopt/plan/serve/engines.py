"""Serving engine generations as the serving planner prices them: how far each sits from the
roofline of `step.py`, and the host time of one iteration.

Apart from step.py so that a scenario can name and check its engine without importing the
step model (which reads scenarios).
"""

from __future__ import annotations

from dataclasses import dataclass

# Host work per iteration (scheduler, sampling, detokenisation, CUDA-graph launch). In-flight
# batching engines report 1-3 ms of CPU time per step hidden partly behind the GPU; 1 ms.
STEP_OVERHEAD_S = 1.0e-3


@dataclass(frozen=True)
class EngineProfile:
    """How far one serving engine generation sits from the roofline priced here. `default`
    (1, 0, 0, STEP_OVERHEAD_S) is the engine the GPU profiles' efficiencies describe (TRT-LLM,
    NIM); the others are fitted on calibration rows only (`ENGINE_PROFILES`)."""

    gpu_time_scale: float = 1.0  # every GPU term of an iteration (kernels of that engine)
    request_s: float = 0.0  # per request outside the iterations (tokenise, IPC, HTTP), in TTFT
    # launch time per layer of an iteration that carries prompt tokens: engines that replay
    # CUDA graphs for decode batches only (SGLang, vLLM V0) launch a prefill kernel by kernel
    eager_layer_s: float = 0.0
    overhead_s: float = STEP_OVERHEAD_S


# Fitted on the calibration rows of llmopt/validate/data/calibration_serving_online.csv only
# (SGLang's benchmark_vllm_060 README @120affb9: SGLang v0.3.0 and vLLM v0.6.0, bf16 Llama 3.1
# 8B on A100 and 70B on 4 H100, median TTFT/ITL at 4 and 8 req/s and offline tokens/s) by
# `llmopt.validate.serving_runs.fit_engine` (`python benchmarks/validate_serving.py
# --fit-engines`), rounded: least squares on log errors over those 12 rows' 20 figures. Before
# the fit those rows ran 1.4-1.6x faster than measured; the per-layer launch term was added
# after the first held-out figures had been printed (see docs/benchmarks/planner.md).
ENGINE_PROFILES: dict[str, EngineProfile] = {
    "default": EngineProfile(),
    "sglang-2024": EngineProfile(gpu_time_scale=1.36, request_s=4.5e-3, eager_layer_s=131e-6),
    "vllm-2024": EngineProfile(gpu_time_scale=1.35, request_s=19.2e-3, eager_layer_s=219e-6),
}
