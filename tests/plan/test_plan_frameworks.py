"""Framework profiles inside the search, the exporters' refusals, and --why-not vs the ranking."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from llmopt.models.presets import get_preset
from llmopt.plan.emit import EmitError, PlannedRun, check
from llmopt.plan.explain import why_not
from llmopt.plan.frameworks import FRAMEWORKS, FrameworkError, frameworks_running, refusal
from llmopt.plan.hardware import get_cluster
from llmopt.plan.rules import parse_constraints
from llmopt.plan.search import build_grid, evaluate, plan_at, plan_of_rank, ranked, search
from llmopt.plan.workload import Workload

MODEL = get_preset("llama-3-70b")
CLUSTER = get_cluster("dgx-h100", 8)
WORK = Workload()

# (model, cluster preset, nodes, seq_len, global batch)
SCENARIOS = [
    ("llama-3-70b", "dgx-h100", 8, 4096, 1024),
    ("llama-3-70b", "dgx-h100", 4, 4096, 512),
    ("llama-3-70b", "dgx-h200", 2, 8192, 256),
    ("llama-3-70b", "dgx-a100-80gb", 16, 2048, 1536),
    ("llama-3-8b", "dgx-h100", 1, 8192, 128),
    ("llama-3-8b", "dgx-a100-80gb", 4, 4096, 512),
    ("llama-3.1-405b", "dgx-h100", 16, 4096, 1024),
    ("llama-3.1-405b", "dgx-b200", 8, 8192, 512),
]


@pytest.mark.parametrize("framework", ["deepspeed"])
def test_pipeline_frameworks_never_return_zero2_or_3_with_pp(framework):
    """DeepSpeed's pipeline engine asserts ZeRO<=1: not one valid plan of any scenario has
    ZeRO-2/3 with pp>1, while the unrestricted search does have such plans. (Megatron-LM refuses
    PP only with --use-torch-fsdp2, not with Megatron-FSDP; issue 27.)"""
    found_unrestricted = 0
    for name, preset, nodes, seq, batch in SCENARIOS:
        model, cluster = get_preset(name), get_cluster(preset, nodes)
        work = Workload(seq_len=seq, global_batch=batch)
        result = search(model, work, cluster, top_k=20, framework=framework)
        ev = result.evaluation
        bad = ev.valid & (ev.grid["pp"] > 1) & (ev.grid["zero"] >= 2)
        assert not bad.any(), (name, preset, nodes)
        for p in result.plans:
            assert not (p.parallel.pp > 1 and p.parallel.zero_stage >= 2)
        free = evaluate(model, work, cluster, ev.grid, with_comm=False)
        found_unrestricted += int(
            (free.valid & (free.grid["pp"] > 1) & (free.grid["zero"] >= 2)).sum()
        )
    assert found_unrestricted > 1000


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "torchtitan", "nemo"])
def test_search_and_exporter_apply_the_same_rules(framework):
    """A plan is valid under --framework F exactly when it is valid for llmopt and F's exporter
    accepts it (every plan of the grid is checked against the exporter)."""
    grid = build_grid(MODEL, WORK, CLUSTER)
    free = evaluate(MODEL, WORK, CLUSTER, grid, with_comm=False)
    fw = evaluate(MODEL, WORK, CLUSTER, grid, with_comm=False, framework=framework)
    rng = np.random.default_rng(0)
    idx = np.flatnonzero(free.valid)
    accepted = 0
    for i in rng.choice(idx, size=min(300, len(idx)), replace=False):
        run = PlannedRun(MODEL, "llama-3-70b", WORK, CLUSTER, plan_at(free, int(i)))
        try:
            check(run, framework)
            ok = True
        except EmitError as exc:
            ok = False
            assert str(exc) == refusal(framework, MODEL, run.parallel, run.plan.grad_reduce)
        assert bool(fw.valid[i]) == ok, run.parallel.short()
        accepted += ok
    assert accepted > 0
    assert not (fw.valid & ~free.valid).any()  # a framework never admits an invalid plan
    if framework in ("torchtitan", "deepspeed"):  # whose rules refuse valid plans here
        assert fw.valid.sum() < free.valid.sum()


def test_runs_on_names_the_frameworks_that_accept_the_plan():
    result = search(MODEL, WORK, CLUSTER, top_k=1)
    top = result.plans[0].parallel
    names = frameworks_running(MODEL, top)
    assert "llmopt" in names
    for f in FRAMEWORKS:
        assert (f in names) == (refusal(f, MODEL, top) is None)
    ds = search(MODEL, WORK, CLUSTER, top_k=1, framework="deepspeed").plans[0].parallel
    assert "deepspeed" in frameworks_running(MODEL, ds)


def test_unknown_framework_is_one_line_error():
    with pytest.raises(
        FrameworkError, match="--framework='slurm' is not valid; choose one of llmopt"
    ):
        search(MODEL, WORK, CLUSTER, framework="slurm")


def _specs() -> list[str]:
    specs = [f"tp={t}" for t in (1, 2, 4, 8, 16)] + [f"pp={p}" for p in (1, 2, 4, 8, 16)]
    specs += [f"zero_stage={z}" for z in range(4)]
    specs += [f"tp={t},pp={p}" for t, p in itertools.product((2, 4, 8), (2, 4, 8))]
    specs += ["pp=8,zero_stage=2", "pp=4,zero_stage=3", "tp=8,pp=1,zero_stage=0", "cp=2"]
    specs += ["schedule=gpipe", "schedule=interleaved", "recompute=selective", "tp=16,cp=2"]
    return specs


@pytest.mark.parametrize("framework", ["llmopt", "megatron", "deepspeed"])
def test_why_not_agrees_with_the_ranking(framework):
    """For every spec: why-not's rank is the ranking's first plan with those settings (and none
    ranks above it); 'rejected' exactly when no valid plan has them."""
    result = search(MODEL, WORK, CLUSTER, top_k=10, framework=framework)
    order = ranked(result.evaluation)
    g = result.evaluation.grid
    verdicts = set()
    for spec in _specs():
        c = parse_constraints(spec)
        lines = why_not(MODEL, WORK, CLUSTER, c, result)
        match = np.ones(len(order), dtype=bool)
        for key, value in c.items():
            match &= g[key][order] == value
        found = re.search(r"ranks #(\d+)", lines[0])
        if match.any():
            assert found, (spec, lines[0])
            rank = int(found.group(1))
            assert rank == int(np.argmax(match)) + 1
            plan = plan_of_rank(MODEL, WORK, CLUSTER, result, rank).parallel
            for key, value in c.items():
                assert int(g[key][order[rank - 1]]) == value
            assert plan.short() in lines[0]
            verdicts.add("valid")
        else:
            assert not found and "rejected" in lines[0], (spec, lines[0])
            verdicts.add("rejected")
    assert verdicts == {"valid", "rejected"}


def test_why_not_names_the_framework_rule():
    result = search(MODEL, WORK, CLUSTER, top_k=1, framework="deepspeed")
    lines = why_not(MODEL, WORK, CLUSTER, parse_constraints("pp=8,zero_stage=2"), result)
    assert "rejected" in lines[0]
    # the rule that rejects every variant comes first
    assert lines[1].startswith("  - DeepSpeed cannot express zero_stage=2 with pp=8")
    assert "(2304 of 2304 variants)" in lines[1]  # x2: both ZeRO-2 gradient policies


def test_cli_json_names_where_the_plan_runs(capsys):
    import json

    from llmopt.cli import main

    assert main(["plan", "--framework", "megatron", "--json", "--top-k", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["framework"] == "megatron" and "megatron" in data["runs_on"]
    assert set(data["runs_on"]) | set(data["not_on"]) == set(FRAMEWORKS)
    for why in data["not_on"].values():
        assert why.startswith(("Megatron-LM", "Megatron-Bridge", "torchtitan", "DeepSpeed",
                               "llmopt"))  # fmt: skip


def test_every_framework_rule_cites_its_source_at_a_pinned_commit():
    from llmopt.plan.frameworks import rule_sources

    for name in ("megatron", "nemo", "torchtitan", "deepspeed"):
        for what, source in rule_sources(name):
            assert re.search(r"@[0-9a-f]{8}|==\d|torch==", source), (name, what, source)
            assert re.search(r"\.py", source), (name, what, source)


def test_megatron_and_nemo_accept_the_published_uneven_and_bf16_recipes():
    """Issue 27: Megatron-LM runs 126 layers over pp 8 x vp 8 (NeMo's 405B recipe, with
    --account-for-embedding/loss-in-pipeline-split or a layout), and NeMo's performance recipes
    reduce gradients in bf16; DeepSeek-V3's 61 layers get pipeline parallelism."""
    from llmopt.parallel.plan import ParallelPlan

    llama = get_preset("llama-3.1-405b")
    plan = ParallelPlan(tp=8, pp=8, dp=8, cp=2, sequence_parallel=True, zero_stage=1,
                        micro_batch=1, num_microbatches=64, schedule="interleaved",
                        virtual_stages=8, precision="fp8", reduce_dtype="bf16")  # fmt: skip
    assert refusal("megatron", llama, plan) is None
    assert refusal("nemo", llama, plan) is None
    dsv3 = get_preset("deepseek-v3")
    plan16 = ParallelPlan(tp=1, pp=16, dp=16, ep=8, zero_stage=1, micro_batch=1,
                          num_microbatches=128, precision="fp8", reduce_dtype="bf16")  # fmt: skip
    assert refusal("nemo", dsv3, plan16) is None
    # torchtitan: 126 layers + embedding + output = 128 weighted units over 64 stages is a
    # split its layers_per_stage=2 expresses
    titan = plan.replace(zero_stage=2, reduce_dtype="fp32")
    assert refusal("torchtitan", llama, titan, grad_reduce="step") is None


def test_nemo_defaults_to_its_recipes_bf16_reduce(capsys):
    from llmopt.cli import main

    assert main(["plan", "--framework", "nemo", "--top-k", "1", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["state_bytes"] == "zero"
    assert out["plans"][0]["reduce_dtype"] == "bf16"
    assert main(["plan", "--framework", "nemo", "--reduce-dtype", "fp32", "--top-k", "1",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["plans"][0]["reduce_dtype"] == "fp32"


def test_nemos_published_mappings_are_valid_under_nemo():
    """Issue 27: NeMo's published 70B/405B (H100, B200) and DeepSeek-V3 mappings are valid plans
    under --framework nemo (their distance to #1 is recorded in docs/benchmarks/planner.md)."""
    from llmopt.validate.mappings import check

    rows = check("nemo")
    assert len(rows) == 5
    for r in rows:
        assert r.valid, (r.label, r.reason)
        assert r.published_s > 0 and r.rank >= 1
    # the two the issue names as broken before: 405B on 1,024 H100 and DeepSeek-V3 on GB200
    near = {r.label: r.gap for r in rows}
    assert near["Llama 3.1 405B, 1,024 H100"] <= 0.05
    assert near["DeepSeek-V3, 256 GB200"] <= 0.05
    # each case as its 25.11 run was configured (Megatron-Bridge v0.2.1): B200 without a flex
    # backend and "w/ MTP", GB200 with HybridEP and "w/o MTP"
    from llmopt.validate.mappings import CASES

    runs = {c[0]: c[-2:] for c in CASES}
    assert runs["DeepSeek-V3, 256 B200"] == ("alltoall", 1)
    assert runs["DeepSeek-V3, 256 GB200"] == ("hybridep", 0)
