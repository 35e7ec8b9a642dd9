"""What `llmopt plan serve` is asked: one serving scenario (model, GPU, mapping, precision,
lengths, load), validated on construction so a bad value fails early with a one-line error.

Precisions are the serving formats engines ship: bf16, fp8 (W8A8, FP8 tensor cores), int8
(W8A8 SmoothQuant-style, INT8 tensor cores) and int4-awq (4-bit weights, bf16 activations).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmopt.errors import LlmoptError

PRECISIONS = ("bf16", "fp8", "int8", "int4-awq")
# how the engine's scheduler mixes prompts and decoding sequences (`simulate.py`)
SCHEDULERS = ("mixed", "prefill-first")
# how it admits requests into the KV cache: the whole final length (TRT-LLM's
# GUARANTEED_NO_EVICT), the prompt's blocks only (vLLM; the newest is preempted when decoding
# runs out) or SGLang's estimate of the tokens still to come (new_token_ratio; retraction)
ADMISSIONS = ("reserve", "on-demand", "estimate")
KV_DTYPES = ("bf16", "fp8")
# bytes per GEMM weight; int4-awq adds one fp16 scale and one zero point per 128 weights
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4-awq": 0.5 + 4.0 / 128}
KV_BYTES = {"bf16": 2, "fp8": 1}


class ServeInputError(LlmoptError, ValueError):
    """A serving scenario the planner cannot evaluate (names the bad value and what is valid)."""


@dataclass(frozen=True)
class Load:
    """Offered load of the whole deployment: a closed loop of `concurrency` clients, an open
    Poisson stream of `rate` requests/s, or `offline` (every request queued at once)."""

    kind: str  # "concurrency" | "rate" | "offline"
    value: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("concurrency", "rate", "offline"):
            raise ServeInputError(f"load kind {self.kind!r}; valid: concurrency, rate, offline")
        if self.kind == "offline":
            return
        if not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise ServeInputError(f"{self.kind}={self.value!r} must be a finite number")
        if self.value <= 0:
            raise ServeInputError(f"{self.kind}={self.value:g} must be positive")
        if self.kind == "concurrency" and self.value != int(self.value):
            raise ServeInputError(f"concurrency={self.value:g} must be a whole number of clients")

    def __str__(self) -> str:
        if self.kind == "offline":
            return "offline"
        return f"{self.kind}={self.value:g}"

    def split(self, replicas: int) -> Load:
        """The share of one of `replicas` identical replicas (requests spread evenly)."""
        if self.kind == "offline":
            return self
        if self.kind == "concurrency":
            return Load("concurrency", float(math.ceil(self.value / replicas)))
        return Load("rate", self.value / replicas)


_LOAD_RE = re.compile(
    r"^\s*(?P<kind>offline|concurrency|conc|c|rate|qps|rps)?\s*[=:]?\s*(?P<num>[-+0-9.eE]*|inf|nan)"
    r"\s*(?P<unit>req/s|rps|qps|users?|clients?)?\s*$",
    re.IGNORECASE,
)


def parse_load(text: str) -> Load:
    """`offline`, `concurrency=N` (also `c=N`, `N users`), `rate=R` (also `qps=R`, `R req/s`)."""
    m = _LOAD_RE.match(str(text))
    if (
        not m
        or (not m["kind"] and not m["unit"])
        or (m["kind"] or "").lower() != "offline"
        and not m["num"]
    ):
        raise ServeInputError(
            f"load {text!r} is not understood; valid: offline, concurrency=N, rate=R (req/s)"
        )
    kind = (m["kind"] or "").lower()
    unit = (m["unit"] or "").lower()
    if kind == "offline":
        if m["num"]:
            raise ServeInputError(f"load {text!r}: offline takes no number")
        return Load("offline")
    try:
        num = float(m["num"])
    except ValueError:
        raise ServeInputError(f"load {text!r}: {m['num']!r} is not a number") from None
    if kind in ("rate", "qps", "rps") or unit in ("req/s", "rps", "qps"):
        return Load("rate", num)
    return Load("concurrency", num)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ServeInputError(f"{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class Scenario:
    """One replica of `tp` GPUs serving `load` at fixed lengths; on an MoE model `ep` of those
    GPUs split the experts between them (each expert then tensor-split tp/ep ways, as
    TRT-LLM's moe_ep x moe_tp = tp).

    `num_gpus` is the whole deployment (a multiple of tp; the other GPUs are data-parallel
    replicas sharing the load). Speculative decoding is on when `spec_tokens` > 0: a draft
    proposes that many tokens per step, each accepted with probability `spec_acceptance`,
    at `spec_draft_cost` of a target decode step per drafted token (Leviathan's c)."""

    precision: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int = 1
    ep: int = 1
    num_gpus: int | None = None
    input_len: int = 1024
    output_len: int = 256
    load: Load = Load("concurrency", 32.0)
    max_num_seqs: int = 2048  # scheduler cap on running sequences (TRT-LLM's max_batch_size)
    max_num_tokens: int = 8192  # tokens one step may carry (prefill chunk budget)
    kv_fraction: float = 0.9  # share of the memory left after weights given to the KV cache
    spec_tokens: int = 0
    spec_acceptance: float = 0.0
    spec_draft_cost: float = 0.0
    # online serving at a request rate is simulated iteration by iteration (`simulate.py`):
    # the scheduler, decode steps per scheduling round (vLLM's --num-scheduler-steps), the
    # requests of the benchmark, the lower ends of uniform length ranges (None: every request
    # has input_len / output_len; else uniform integers in [min, len], as SGLang's and vLLM's
    # "random" datasets draw them) and the seed of the arrivals and lengths
    scheduler: str = "mixed"
    multi_step: int = 1
    num_requests: int = 1000
    input_len_min: int | None = None
    output_len_min: int | None = None
    seed: int = 0
    engine: str = "default"  # an `EngineProfile` name (engines.ENGINE_PROFILES)
    admission: str = "reserve"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ServeInputError(
                f"precision {self.precision!r} is not supported; valid: {', '.join(PRECISIONS)}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ServeInputError(
                f"kv dtype {self.kv_dtype!r} is not supported; valid: {', '.join(KV_DTYPES)}"
            )
        for name in ("tp", "ep", "input_len", "output_len", "max_num_seqs", "max_num_tokens"):
            _positive_int(name, getattr(self, name))
        if self.scheduler not in SCHEDULERS:
            raise ServeInputError(
                f"scheduler {self.scheduler!r} is not known; valid: {', '.join(SCHEDULERS)}"
            )
        from llmopt.plan.serve.engines import ENGINE_PROFILES

        if self.engine not in ENGINE_PROFILES:
            raise ServeInputError(
                f"engine {self.engine!r} is not known; valid: {', '.join(ENGINE_PROFILES)}"
            )
        if self.admission not in ADMISSIONS:
            raise ServeInputError(
                f"admission {self.admission!r} is not known; valid: {', '.join(ADMISSIONS)}"
            )
        for name in ("multi_step", "num_requests"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ServeInputError(f"seed={self.seed!r} must be an integer")
        for name, top in (("input_len_min", "input_len"), ("output_len_min", "output_len")):
            lo = getattr(self, name)
            if lo is not None:
                _positive_int(name, lo)
                if lo > getattr(self, top):
                    raise ServeInputError(f"{name}={lo} must not exceed {top}={getattr(self, top)}")
        if self.num_gpus is not None:
            _positive_int("num_gpus", self.num_gpus)
            if self.num_gpus % self.gpus_per_replica:
                raise ServeInputError(f"num_gpus={self.num_gpus} is not a multiple of tp={self.tp}")
        if self.tp % self.ep:
            raise ServeInputError(
                f"ep={self.ep} must divide tp={self.tp} (experts split over the TP group)"
            )
        if not isinstance(self.load, Load):
            raise ServeInputError(f"load={self.load!r} must be a Load (see parse_load)")
        for name, lo, hi in (
            ("kv_fraction", 0.0, 1.0),
            ("spec_acceptance", 0.0, 1.0),
            ("spec_draft_cost", 0.0, math.inf),
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise ServeInputError(f"{name}={v!r} must be a finite number in [{lo:g}, {hi:g}]")
        if self.kv_fraction == 0:
            raise ServeInputError("kv_fraction=0 leaves no memory for the KV cache")
        if self.spec_tokens < 0 or isinstance(self.spec_tokens, bool):
            raise ServeInputError(f"spec_tokens={self.spec_tokens!r} must be >= 0")
        if self.spec_tokens and self.spec_acceptance >= 1.0:
            raise ServeInputError("spec_acceptance must be below 1 (1 would accept every guess)")

    @property
    def tokens_per_round(self) -> float:
        """Leviathan et al. 2023, Eq. 1: expected tokens one target verification of k drafted
        tokens yields when each is accepted with probability α: (1 − α^(k+1)) / (1 − α)."""
        k, a = self.spec_tokens, self.spec_acceptance
        return 1.0 if k == 0 else (1 - a ** (k + 1)) / (1 - a)

    @property
    def mean_input_len(self) -> float:
        lo = self.input_len if self.input_len_min is None else self.input_len_min
        return (lo + self.input_len) / 2

    @property
    def mean_output_len(self) -> float:
        lo = self.output_len if self.output_len_min is None else self.output_len_min
        return (lo + self.output_len) / 2

    @property
    def gpus_per_replica(self) -> int:
        return self.tp

    @property
    def replicas(self) -> int:
        return (self.num_gpus or self.gpus_per_replica) // self.gpus_per_replica
