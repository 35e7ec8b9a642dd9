"""`llmopt report`: Markdown parsing, trade-off rows against baselines, and the page in Chromium."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmopt.cli import main
from llmopt.report.collect import ReportSourceError, collect
from llmopt.report.html import render
from llmopt.report.markdown import parse
from llmopt.report.tradeoff import classify, table_rows, tradeoff_rows
from tests.paths import REPO

REPO = REPO
DOC = """## Decode speed

Machine: 2-core CPU, shared.

```bash
python benchmarks/x.py --out runs/x.json
```

| weights | tok/s | weights MiB | ppl |
|---|---:|---:|---:|
| fp32 | 4.00 | 512 | 7.90 |
| **INT4** g128 | **10.0** | 128 | 9.0 |

- one bullet
  continued

![plot](plot.png)
"""


def test_markdown_blocks():
    blocks = parse(DOC)
    assert [b.kind for b in blocks] == ["heading", "paragraph", "code", "table", "bullets", "image"]
    assert blocks[2].text == "python benchmarks/x.py --out runs/x.json" and blocks[2].lang == "bash"
    assert blocks[3].header == ["weights", "tok/s", "weights MiB", "ppl"]
    assert blocks[3].rows[1] == ["**INT4** g128", "**10.0**", "128", "9.0"]
    assert blocks[4].items == ["one bullet continued"]
    assert (blocks[5].text, blocks[5].src) == ("plot", "plot.png")


def test_columns_classified_and_ratios_against_the_baseline_row():
    assert [classify(h) for h in ("peak MiB", "GB/s", "weights MiB", "KL mean", "method")] == [
        "memory",
        "speed",
        "size",
        "accuracy",
        None,
    ]
    table = parse(DOC)[3]
    base, int4 = table_rows("doc", table.header, table.rows)
    assert (int4.variant, int4.baseline) == ("INT4 g128", "fp32")
    assert int4.cells["speed"].ratio == pytest.approx(2.5)
    assert int4.cells["size"].ratio == pytest.approx(0.25)
    assert int4.cells["accuracy"].render() == "ppl: 9.0 (1.14x)"
    assert all(c.ratio is None for c in base.cells.values())


def _write_results(root: Path) -> None:
    kl = {"mean": 0.5, "top1_agreement": 0.7, "ppl": 12.0, "ref_ppl": 8.0}
    gate = {"model": "q/rtn-w3", "ref": "smollm2-135m", "passed": False, "gates": [], "kl": kl}
    quant = {"method": "rtn", "bits": 3, "group_size": 128, "quant_linear_bytes": 30 * 2**20}
    quant |= {"quant_linear_fp16_bytes": 160 * 2**20, "other_bytes": 40 * 2**20}

    def profile(model, ms, peak):
        return {
            "model": model,
            "prefill": {},
            "peaks": {},
            "decode": {"unprofiled_wall_ms_per_step": ms},
            "memory": {"peak_bytes": peak},
        }

    files = {
        "rtn-w3/gate.json": gate,
        "rtn-w3/quantize.json": quant,
        "rtn-w3/ops.json": profile("q/rtn-w3", 20.0, 100 * 2**20),
        "fp32/ops.json": profile("smollm2-135m", 40.0, 400 * 2**20),
        "fp32/notes.json": {"anything": 1},
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(data))


def test_result_json_rows_against_reference_and_fp16(tmp_path):
    _write_results(tmp_path)
    results = collect(tmp_path)
    assert results.other_json == [Path("fp32/notes.json")]
    rows = {r.source: r for r in tradeoff_rows(results)}
    q = rows["rtn-w3"]
    assert (q.variant, q.baseline) == ("rtn W3 g128", "smollm2-135m")
    assert q.cells["accuracy"].ratio == pytest.approx(1.5)  # ppl 12 vs reference 8
    assert q.cells["accuracy"].value.endswith("gates FAILED")
    assert q.cells["size"].ratio == pytest.approx(70 / 200)
    assert q.cells["speed"].ratio == pytest.approx(0.5)  # vs the reference model's profile
    assert q.cells["memory"].ratio == pytest.approx(0.25)
    assert rows["fp32"].cells["speed"].ratio is None


def test_bad_sources(tmp_path):
    with pytest.raises(ReportSourceError, match="is not a directory"):
        collect(tmp_path / "nope")
    with pytest.raises(ReportSourceError, match="no results under"):
        collect(tmp_path)
    (tmp_path / "bad.json").write_text("{")  # e.g. a run still writing it
    (tmp_path / "a.md").write_text("## A\n\ntext\n")
    results = collect(tmp_path)
    assert [p for p, _ in results.unreadable] == [Path("bad.json")]
    assert "not valid JSON" in results.unreadable[0][1]
    assert "bad.json</code>: not valid JSON" in render(results)


def _browser_check(page_path: Path, screenshot: Path) -> dict:
    """Load the page in headless Chromium: image states, console errors, a screenshot."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "headless Chromium is needed: apt-get install -y chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        page.goto(page_path.as_uri(), wait_until="load")
        images = page.evaluate(
            "Array.from(document.images).map(i => ({ok: i.complete && i.naturalWidth > 0, "
            "data: i.src.startsWith('data:image/')}))"
        )
        tables = page.evaluate("document.querySelectorAll('table').length")
        page.screenshot(path=str(screenshot), full_page=False)
        browser.close()
    return {"images": images, "errors": errors, "tables": tables}


def test_report_of_the_repo_benchmarks_renders_in_chromium(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(REPO / "docs" / "benchmarks"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert "<link" not in text and "<script" not in text and 'src="http' not in text
    found = collect(REPO / "docs" / "benchmarks")
    referenced = {p for w in found.writeups for p in w.images}
    figures = sum(1 for w in found.writeups for b in w.blocks if b.src in w.image_map)
    unreferenced = [p for p in found.images if (found.root / p).resolve() not in referenced]
    expected_images = figures + len(unreferenced)
    result = _browser_check(out, tmp_path / "shot.png")
    assert result["errors"] == []
    assert len(result["images"]) == expected_images > 0
    assert all(i["ok"] and i["data"] for i in result["images"]), result["images"]
    assert result["tables"] > 1  # the trade-off table and the write-ups' tables
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_cli_bad_out(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.txt")]) == 2
    assert "must end in .html" in capsys.readouterr().err
