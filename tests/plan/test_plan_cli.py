"""`llmopt plan` command line: default run, JSON schema, estimate, compare, why-not, errors."""

from __future__ import annotations

import json

import pytest

from llmopt.cli import main
from llmopt.parallel.plan import ParallelPlan
from tests.paths import REPO

PLAN_KEYS = set(ParallelPlan.field_names()) | {
    "fits", "memory_gib", "step_time_s", "tokens_per_s", "mfu", "hfu",
    "comm_bytes_per_gpu_per_step", "explanation",
}  # fmt: skip
TIME_KEYS = {
    "total", "compute", "recompute", "tp_comm_exposed", "pp_bubble", "pp_p2p",
    "dp_comm_exposed", "optimizer",
}  # fmt: skip


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_default_plan_prints_table_and_explanation(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-70b on 8x8 H100" in out
    assert "Why the top plan" in out and "MFU" in out
    assert "PP=" in out and "spans nodes" in out


def test_plan_json_schema(capsys):
    data = _json(capsys, ["plan", "--json", "--top-k", "3"])
    assert len(data["plans"]) == 3
    for plan in data["plans"]:
        assert PLAN_KEYS <= set(plan)
        assert "sp" not in plan and "zero" not in plan
        ParallelPlan.from_dict({k: plan[k] for k in ParallelPlan.field_names()})
        assert TIME_KEYS <= set(plan["step_time_s"])
        assert set(plan["memory_gib"]) == {
            "params", "grads", "optimizer", "activations", "other", "total",
        }  # fmt: skip
        assert set(plan["comm_bytes_per_gpu_per_step"]) == {"intra_node", "inter_node"}
    assert all(plan["explanation"] for plan in data["plans"])
    assert data["plans"][1]["explanation"][-1].startswith("Ranked #2")


def test_estimate_json_lists_collectives_with_links(capsys):
    data = _json(
        capsys,
        ["plan", "estimate", "--tp", "8", "--pp", "8", "--sequence-parallel", "--micro-batch", "2",
         "--json"],
    )  # fmt: skip
    assert data["plan"]["dp"] == 1 and data["plan"]["num_microbatches"] == 512
    assert data["plan"]["sequence_parallel"] is True
    links = {(c["group"], c["link"]) for c in data["collectives"]}
    assert ("tp", "intra_node") in links and ("pp", "inter_node") in links


def test_compare_tp_across_nodes_is_slower_with_more_network_bytes(capsys):
    data = _json(
        capsys, ["plan", "compare", "tp=8,pp=8", "tp=16,pp=4", "dp=64,zero_stage=3", "--json"]
    )
    by = {m["spec"]: m for m in data["mappings"]}
    inside, across = by["tp=8,pp=8"]["plan"], by["tp=16,pp=4"]["plan"]
    assert across["step_time_s"]["total"] > inside["step_time_s"]["total"]
    net = "comm_bytes_per_gpu_per_step"
    assert across[net]["inter_node"] > inside[net]["inter_node"]
    z3 = by["dp=64,zero_stage=3"]["collectives"]
    assert any(c["group"] == "dp" and c["op"] == "all-gather" for c in z3)


def test_why_not(capsys):
    assert main(["plan", "--why-not", "tp=16"]) == 0
    out = capsys.readouterr().out
    assert "tp=16: best such plan" in out and "step time versus the top plan" in out
    assert main(["plan", "--why-not", "tp=8,pp=1,zero_stage=0"]) == 0
    out = capsys.readouterr().out
    assert "rejected" in out and "GiB per GPU, more than" in out
    data = _json(capsys, ["plan", "--why-not", "tp=3", "--json"])
    assert "tp=3 does not divide the 64 GPUs" in data["why_not"]["explanation"][0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--nodes", "0"], "--nodes=0 must be a positive integer"),
        (["plan", "--model", "llama-3.1-405b", "--nodes", "1"], "GiB more than"),
        (["plan", "--model", "nope"], "unknown model preset 'nope'"),
        (["plan", "--ib-gbs", "-1"], "--ib-gbs=-1.0 must be a positive number"),
        (["plan", "--num-heads", "60"], "num_kv_heads=8 does not divide num_heads=60"),
        (["plan", "--num-layers", "0"], "--num-layers=0 must be a positive integer"),
        (
            ["plan", "--num-experts", "8"],
            "--num-experts: --model llama-3-70b has no experts (dense)",
        ),
        (
            ["plan", "--model", "mixtral-8x7b", "--expert-ffn-hidden", "0"],
            "--expert-ffn-hidden=0 must be a positive integer",
        ),
        (["plan", "--why-not", "zero=3"], "unknown mapping key 'zero'"),
        (["plan", "--where", "tp=3"], "tp=3 does not divide the 64 GPUs"),
        (["plan", "--global-batch-tokens", "5000"], "multiple of --seq-len=4096"),
        (["plan", "--precision", "fp8", "--cluster", "dgx-a100-80gb"], "has no FP8"),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_hf_config_and_explicit_dims(capsys, tmp_path):
    from llmopt.models.presets import get_preset

    path = tmp_path / "config.json"
    path.write_text(json.dumps(get_preset("llama-3-8b").to_hf_config()))
    data = _json(capsys, ["plan", "--model", str(path), "--nodes", "1", "--json", "--top-k", "1"])
    assert data["parameters"] == get_preset("llama-3-8b").num_parameters()
    assert data["plans"][0]["fits"]
    argv = ["plan", "--model", "llama-3-8b", "--num-layers", "16", "--nodes", "1", "--json"]
    data = _json(capsys, argv)
    assert data["model"] == "llama-3-8b (custom)"
    assert data["parameters"] < get_preset("llama-3-8b").num_parameters()


def test_plot_writes_png(capsys, tmp_path):
    out = tmp_path / "sub" / "plans.png"
    assert main(["plan", "--top-k", "3", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cmp = tmp_path / "cmp.png"
    assert main(["plan", "compare", "tp=8,pp=8", "dp=64,zero_stage=3", "--plot", str(cmp)]) == 0
    assert cmp.read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.rglob("*.tmp.png"))


def test_estimate_takes_the_trainer_flag_names(capsys):
    argv = ["plan", "estimate", "--tp", "8", "--pp", "2", "--dp", "4", "--zero-stage", "1",
            "--num-microbatches", "64", "--micro-batch", "4", "--sequence-parallel", "--recompute", "selective",
            "--reduce-dtype", "bf16", "--json"]  # fmt: skip
    plan = _json(capsys, argv)["plan"]
    assert (plan["zero_stage"], plan["num_microbatches"], plan["micro_batch"]) == (1, 64, 4)
    assert plan["rejected"] == [] and plan["fits"]
    assert plan["recompute"] == "selective" and plan["reduce_dtype"] == "bf16"
    # bf16 gradients: 2 bytes per parameter instead of fp32's 4
    fp32 = _json(capsys, argv[:-3] + ["--json"])["plan"]
    assert plan["memory_gib"]["grads"] == pytest.approx(fp32["memory_gib"]["grads"] / 2, rel=1e-3)


def test_where_restricts_the_ranking(capsys):
    data = _json(capsys, ["plan", "--where", "tp=2,pp=2,sequence_parallel=false", "--json",
                          "--model", "llama-3-8b", "--nodes", "2", "--top-k", "3"])  # fmt: skip
    assert data["where"] == "tp=2,pp=2,sequence_parallel=false"
    for plan in data["plans"]:
        assert (plan["tp"], plan["pp"], plan["dp"], plan["sequence_parallel"]) == (2, 2, 4, False)


NO_TORCH = """
import sys
from llmopt.cli import main
assert main(sys.argv[1:]) == 0
heavy = sorted(m for m in ("torch", "numpy.testing", "transformers") if m in sys.modules)
print("HEAVY", heavy)
"""


@pytest.mark.parametrize(
    "argv", [["plan"], ["plan", "--top-k", "2", "--where", "virtual_stages=2", "--emit", "{tmp}/run.toml"],
             ["plan", "--emit", "{tmp}/x.megatron.sh"], ["plan", "compare"]],
)  # fmt: skip
def test_plan_never_imports_torch(argv, tmp_path):
    import subprocess
    import sys

    root = REPO
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True,
                         cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--cp", "--micro-batch", "--dp"])
def test_estimate_zero_degree_is_one_line_error(flag, capsys):
    assert main(["plan", "estimate", flag, "0"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{flag}=0 must be a positive integer") and len(err.splitlines()) == 1


def test_cluster_file_nodes_and_modified_gpu_name(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('base = "dgx-h100"\nnodes = 2\n[gpu]\nhbm_gib = 96.0\n')
    data = _json(capsys, ["plan", "--cluster", str(path), "--json", "--top-k", "1"])
    assert data["cluster"]["nodes"] == 2  # not the CLI's default of 8
    assert data["cluster"]["gpu"] == "H100-SXM5-80GB modified (hbm_gib=96)"
    data = _json(capsys, ["plan", "--cluster", str(path), "--nodes", "4", "--json", "--top-k", "1"])
    assert data["cluster"]["nodes"] == 4
    data = _json(capsys, ["plan", "--json", "--top-k", "1"])
    assert (data["cluster"]["nodes"], data["cluster"]["gpu"]) == (8, "H100-SXM5-80GB")


def test_data_parallel_link_is_named_by_the_cluster(capsys):
    argv = ["plan", "estimate", "--tp", "8", "--pp", "1", "--zero-stage", "1"]
    argv += ["--recompute", "full", "--micro-batch", "1"]
    data = _json(capsys, [*argv, "--json"])
    expl = " ".join(data["plan"]["explanation"])
    assert "reduces gradients over InfiniBand NDR 400Gb/s per GPU" in expl
    assert "GB over NVLink4 (NVSwitch) and" in expl
    one = ["plan", "estimate", "--model", "llama-3-8b", "--tp", "4", "--nodes", "1", "--json"]
    one = _json(capsys, one)
    assert "reduces gradients over NVLink4 (NVSwitch)" in " ".join(one["plan"]["explanation"])


def test_json_collectives_keep_their_phase(capsys):
    argv = ["plan", "estimate", "--tp", "8", "--pp", "8", "--sequence-parallel", "--json"]
    rows = _json(capsys, argv)["collectives"]
    tp = {(r["op"], r["phase"]) for r in rows if r["group"] == "tp"}
    assert {("all-gather", "forward"), ("all-gather", "backward")} <= tp
    assert len({(r["group"], r["op"], r["phase"], r["link"]) for r in rows}) == len(rows)


def test_json_into_a_closed_pipe_exits_quietly():
    import subprocess
    import sys

    root = REPO
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmopt", "plan", "--json", "--top-k", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.stdout.read(1) == b"{"
    proc.stdout.close()  # the reader goes away, as `| head -c 1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_long_top_k_lists_explain_only_the_first_plans_in_full(capsys):
    """Issue 27 item 6: `--top-k N --json` prices alternatives only for the plans a reader is
    shown explained (the first 10); bulk rows carry one line from the ranking itself."""
    import json

    from llmopt.cli import main
    from llmopt.plan.cli.run import EXPLAINED

    assert main(["plan", "--top-k", "14", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert len(plans) == 14
    for i, p in enumerate(plans, start=1):
        if i <= EXPLAINED:
            assert len(p["explanation"]) > 1, i
        else:
            (line,) = p["explanation"]
            assert line.startswith(f"Rank {i}: +") and "versus the top plan" in line
