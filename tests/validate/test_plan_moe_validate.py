"""llmopt.validate on MoE runs: preset model cells, MoE columns, free-text cells read robustly
("not verified" is a blank, zero shared experts and H800 are valid), rows that cannot be
understood reported (never a crash or a silent misread)."""

from __future__ import annotations

import pytest

from llmopt.validate import cells
from llmopt.validate.planner_runs import SETS, evaluate_rows, load_rows

MOE_CSV = SETS["calibration", "moe"]


@pytest.mark.parametrize(
    ("text", "seq", "expected"),
    [
        ("1024", None, 1024),
        ("1,024", None, 1024),
        ("32000 padded", None, 32000),
        ("2K", None, 2048),
        ("~2K (4M tokens)", 2048, 2048),  # the token count decides when seq_len converts it
        ("not stated", None, None),
        ("", None, None),
        ("n/a", None, None),
    ],
)
def test_counts_are_read_robustly(text, seq, expected):
    assert cells.count(text, "global_batch_seqs", seq) == expected


@pytest.mark.parametrize(
    "text", ["4h", "2 (4)", "about a thousand", "1.5", "~500 (1,000,000 tokens)"]
)
def test_counts_that_cannot_be_understood_are_refused(text):
    with pytest.raises(cells.RowError, match="global_batch_seqs="):
        cells.count(text, "global_batch_seqs", 2048)


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("FSDP: off", 0), ("none (PTD-P)", 0), ("DDP", 0), ("ZeRO-1-like", 1),
        ("distributed optimizer (FSDP=0)", 1), ("ZeRO-2", 2), ("FSDP2 (ZeRO-3)", 3),
        ("FSDP", 3), ("not stated", None),
    ],
)  # fmt: skip
def test_sharding_cells(text, stage):
    assert cells.zero_stage(text) == stage


def test_moe_runs_validate_and_odd_rows_are_reported():
    rows = load_rows(MOE_CSV)
    assert len(rows) >= 10 and all(r["source"] and r["locator"] for r in rows)
    keep = [r for r in rows if r["row_id"] in ("101", "110")]
    odd = [dict(keep[0], row_id="901", global_batch_seqs="2 (4)"),
           dict(keep[0], row_id="902", model="mixtral-8x7b", experts="16"),
           dict(keep[0], row_id="903", model="llama-3-8b")]  # fmt: skip
    results, failed = evaluate_rows(keep + odd)
    assert [r.row_id for r in results] == ["101", "110"]
    why = dict(failed)
    assert "global_batch_seqs='2 (4)' gives more than one number" in why["901"]
    assert "experts=16 contradicts preset mixtral-8x7b (8)" in why["902"]
    assert "ep=8 but no experts" in why["903"]  # a dense preset with ep>1 is not planned as MoE
    by_id = {r.row_id: r for r in results}
    assert by_id["110"].plan.ep == 64 and by_id["110"].metric == "tokens/s/GPU"
    assert by_id["101"].measured == 5630


def test_rows_as_people_write_them_are_read():
    """Issue 27 item 7: zero shared experts (Mixtral, Qwen3-MoE), an H800 cluster and a
    "not verified" micro-batch are a valid row and a blank, not a refusal."""
    base = next(r for r in load_rows(MOE_CSV) if r["row_id"] == "110")
    row = dict(base, row_id="950", model="mixtral-8x7b", experts="8", top_k="2",
               shared_experts="0", ep="8", gpu_type="H800 SXM 80GB", micro_batch="not verified",
               global_batch_seqs="256", moe_layers="", expert_ffn_hidden="14336",
               total_gpus="64", dp="64")  # fmt: skip
    results, failed = evaluate_rows([row])
    assert not failed, failed
    (r,) = results
    assert r.plan.ep == 8 and r.gpus == 64
    assert any("micro_batch=" in a and "planner's choice" in a for a in r.assumptions)
    assert cells.count("0", "shared_experts", allow_zero=True) == 0
    with pytest.raises(cells.RowError, match="not a positive integer"):
        cells.count("0", "experts")
    assert cells.is_blank("not verified") and cells.is_blank("Not stated (8?)")


def test_cluster_of_an_h800_row_is_the_h800_profile():
    from llmopt.validate.run_rows import setup_row

    base = next(r for r in load_rows(MOE_CSV) if r["row_id"] == "110")
    setup = setup_row(dict(base, gpu_type="H800"))
    assert setup.cluster.gpu.name.startswith("H800")
    assert setup.cluster.intra_node.bandwidth_gbs == 200.0
