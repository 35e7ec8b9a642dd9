"""benchmarks/validate_planner.py on MoE runs: preset model cells, MoE columns, free-text cells
read robustly, rows that cannot be understood reported (never a crash or a silent misread)."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOE_CSV = ROOT / "benchmarks" / "data" / "published_moe_runs.csv"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
    cells = _load("published_cells")
    assert cells.count(text, "global_batch_seqs", seq) == expected


@pytest.mark.parametrize(
    "text", ["4h", "2 (4)", "about a thousand", "1.5", "~500 (1,000,000 tokens)"]
)
def test_counts_that_cannot_be_understood_are_refused(text):
    cells = _load("published_cells")
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
    assert _load("published_cells").zero_stage(text) == stage


def test_moe_runs_validate_and_odd_rows_are_reported(tmp_path, capsys):
    vp = _load("validate_planner")
    with MOE_CSV.open(newline="") as fh:
        reader = csv.DictReader(fh)
        rows, fields = list(reader), reader.fieldnames
    assert len(rows) >= 10 and all(r["source"] and r["locator"] for r in rows)
    keep = [r for r in rows if r["row_id"] in ("101", "110")]
    odd = [dict(keep[0], row_id="901", global_batch_seqs="2 (4)"),
           dict(keep[0], row_id="902", model="mixtral-8x7b", experts="16"),
           dict(keep[0], row_id="903", model="llama-3-8b")]  # fmt: skip
    sub = tmp_path / "moe.csv"
    with sub.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(keep + odd)
    out = tmp_path / "v.json"
    assert vp.main(["--runs", str(sub), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(r"median_abs_rel_err=[\d.]+ p90_abs_rel_err=[\d.]+ n=2", last), last
    assert "global_batch_seqs='2 (4)' gives more than one number" in text
    assert "experts=16 contradicts preset mixtral-8x7b (8)" in text
    assert "ep=8 but no experts" in text  # a dense preset with ep>1 is not planned as MoE
    data = json.loads(out.read_text())
    by_id = {r["row_id"]: r for r in data["rows"]}
    assert by_id["110"]["plan"]["ep"] == 64 and by_id["110"]["metric"] == "tokens/s/GPU"
    assert by_id["101"]["measured"] == 5630
