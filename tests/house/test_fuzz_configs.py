"""Property tests over every config dataclass and typed file reader: any value gives either a
valid object or a ValueError subclass whose message names one of the fields given.

Readers of user files get any JSON/TOML value (bools for ints, NaN, lists for tables); Python
API dataclasses get any value of their declared type, edge values included (0, negatives,
NaN, infinities). Budget: the `llmopt-ci` profile in tests/conftest.py.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmopt.config_files import read_manifest
from llmopt.eval.gate import GateThresholds
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative.loop import SpeculativeConfig
from llmopt.models.config import ModelConfig
from llmopt.models.hf_schema import HF_CONFIG
from llmopt.models.packed.markers import read_marker
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.hardware import load_cluster_toml
from llmopt.plan.profiles import GPUProfile, LinkProfile
from llmopt.plan.workload import Workload
from llmopt.train.config import TrainConfig, file_keys

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.sampled_from([0, 1, 2, 3, 4, 8, -1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(["1f1b", "gpipe", "interleaved", "bf16", "fp8", "fp32", "full", "awq", "2:4"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=4,
)
INTS = st.integers(-(2**31), 2**31) | st.sampled_from([0, 1, 2, 3, 4, -1])
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 0.5, 1.0])


def fields_of(cls) -> list[str]:
    return list(cls.__dataclass_fields__)


def some_of(cls, values=JSON, extra: tuple[str, ...] = ()) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(fields_of(cls) + list(extra)), values, max_size=4)


def assert_names_a_field(exc: Exception, keys) -> None:
    text = str(exc)
    assert "\n" not in text.strip(), text
    assert any(k in text for k in keys), f"{text!r} names none of {sorted(keys)}"


def outcome(build, keys) -> None:
    """`build()` succeeds or raises a ValueError naming one of `keys`."""
    try:
        build()
    except ValueError as exc:
        assert_names_a_field(exc, keys)


@given(st.dictionaries(st.sampled_from([*file_keys(), "zero", "stepz"]), JSON, max_size=4))
def test_train_config_from_dict(data):
    outcome(lambda: TrainConfig.from_dict(data), data.keys())


@given(st.dictionaries(st.sampled_from(["model", "parallel", "planner"]), JSON, max_size=2))
def test_train_config_tables(data):
    keys = [k for v in data.values() if isinstance(v, dict) for k in v] + list(data)
    outcome(lambda: TrainConfig.from_dict(data), keys or ["config"])


@given(some_of(ParallelPlan, extra=("zero",)))
def test_parallel_plan_from_dict(data):
    outcome(lambda: ParallelPlan.from_dict(data), data.keys())


@given(JSON)
def test_parallel_plan_from_any_value(value):
    outcome(lambda: ParallelPlan.from_dict(value), ["parallel plan"])


@given(some_of(PruneConfig))
def test_prune_config_from_dict(data):
    outcome(lambda: PruneConfig.from_dict(data), [*data.keys(), "sparsity"])


_QUANT_TYPED = {
    **{f: INTS for f in fields_of(QuantConfig)},
    **{f: st.booleans() for f in ("sym", "quantize_lm_head", "awq_clip", "gptq_act_order")},
    **{f: FLOATS for f in ("awq_max_shrink", "gptq_damp")},
    "method": st.sampled_from(["rtn", "awq", "gptq", "nope", ""]),
    "backend": st.sampled_from(["auto", "torch", "x"]),
    "calib": st.text(max_size=8),
    "modules": st.lists(st.text(max_size=4), max_size=2),
    "gptq_true_sequential": st.booleans(),
}


@given(st.fixed_dictionaries({}, optional=_QUANT_TYPED))
def test_quant_config_typed(kwargs):
    outcome(lambda: QuantConfig(**kwargs), [*kwargs, "bits", "group_size"])


@given(temperature=FLOATS, top_k=INTS, top_p=FLOATS)
def test_sampling_config(temperature, top_k, top_p):
    def build():
        config = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        assert math.isfinite(config.temperature) and config.temperature >= 0
        assert 0 < config.top_p <= 1 and config.top_k >= 0

    outcome(build, ["temperature", "top_k", "top_p"])


@given(st.fixed_dictionaries({}, optional={k: SCALARS for k in fields_of(GateThresholds)}))
def test_gate_thresholds(kwargs):
    outcome(lambda: GateThresholds(**kwargs), [*kwargs, "gate"])


@given(st.fixed_dictionaries({}, optional={"gamma": INTS, "gamma_min": INTS, "gamma_max": INTS}))
def test_speculative_config(kwargs):
    outcome(lambda: SpeculativeConfig(**kwargs), ["gamma"])


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "seq_len": INTS | st.booleans(),
            "global_batch": INTS | st.booleans(),
            "precision": st.sampled_from(["bf16", "fp8", "fp32", ""]),
            "state_bytes": st.sampled_from(["megatron", "zero", "x"]),
        },
    )
)
def test_workload(kwargs):
    outcome(lambda: Workload(**kwargs), kwargs.keys())


_HF_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@given(st.dictionaries(st.sampled_from(sorted(HF_CONFIG)), JSON, max_size=3))
def test_hf_config_dict(changes):
    def build():
        ModelConfig.from_hf_config({**_HF_BASE, **changes})

    outcome(build, [*changes, "architecture", "rope", "head", "window"])


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # TOML refuses \ud800-style pairs


TEXT = st.text(string.ascii_letters + string.digits + "-_.: é", max_size=5)  # valid TOML strings
TOML_SCALARS = st.booleans() | INTS | FLOATS | TEXT | st.lists(INTS, max_size=2)
CLUSTER_KEYS = ["base", "nodes", "gpus_per_node", "name", "nodez"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@given(
    top=st.dictionaries(st.sampled_from(CLUSTER_KEYS), TOML_SCALARS, max_size=3),
    gpu=st.dictionaries(st.sampled_from(fields_of(GPUProfile) + ["hbm"]), TOML_SCALARS, max_size=2),
    link=st.dictionaries(st.sampled_from(fields_of(LinkProfile)), TOML_SCALARS, max_size=2),
)
def test_cluster_toml(scratch, top, gpu, link):
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    lines += ["[gpu]", *(f"{k} = {_toml_value(v)}" for k, v in gpu.items())]
    lines += ["[inter_node]", *(f"{k} = {_toml_value(v)}" for k, v in link.items())]
    path = scratch / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    try:
        load_cluster_toml(path)
    except ValueError as exc:
        assert str(path) in str(exc) or "cluster" in str(exc), exc
        assert_names_a_field(exc, [*top, *gpu, *link])


MARKER_KEYS = ["format", "version", "model_config", "quant_config", "modules", "weights_sha256"]


class _MarkerError(ValueError):
    pass


@given(st.dictionaries(st.sampled_from(MARKER_KEYS + ["report"]), JSON, max_size=6))
def test_marker(scratch, meta):
    meta = {"format": "llmopt-quant", "version": 1, **meta}
    (scratch / "llmopt_quant.json").write_text(json.dumps(meta))
    try:
        read_marker(
            scratch,
            "llmopt_quant.json",
            "llmopt-quant",
            1,
            tuple(MARKER_KEYS[2:]),
            _MarkerError,
            "q",
        )
    except _MarkerError as exc:
        assert "llmopt_quant.json" in str(exc)
        assert_names_a_field(exc, [*meta, *MARKER_KEYS])


@given(
    st.dictionaries(
        st.sampled_from(["step", "layout", "files", "world_size", "x"]), JSON, max_size=4
    )
)
def test_checkpoint_manifest(scratch, manifest):
    (scratch / "manifest.json").write_text(json.dumps(manifest))
    try:
        read_manifest(scratch)
    except ValueError as exc:
        assert "manifest.json" in str(exc)
        assert_names_a_field(exc, [*manifest, "step", "layout"])
