"""Bad input through the real CLI: one line naming the flag / file / key, exit 2, never a
traceback (issue 18, findings 7, 9 and 10; issue 30). The cases are the reliability sweep's
(`llmopt.validate.reliability`); CI's quick tier runs its sample, the benchmark
`benchmarks/reliability_sweep.py` all of them."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt import cli
from llmopt.config_files import ConfigFileError, check_output, read_manifest, read_pointer
from llmopt.validate.reliability import CASES, Case, builders, classify, run_case, sample
from tests.paths import REPO

ROOT = REPO
QUICK = sample()
MODEL = [c for c in CASES if c.kind == "model directory" and c.local]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", QUICK, ids=[c.name for c in QUICK])
def test_bad_input_is_one_clean_line(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_case(case, tmp_path)
    assert result["outcome"] == "clean", result


def test_the_sample_holds_every_named_quick_case_and_the_catalogue_every_issue_30_case():
    named = {c.name for c in CASES if c.named and c.local and not c.needs_model}
    assert named <= {c.name for c in QUICK}
    assert len(QUICK) >= 40 and len(CASES) >= 140
    kinds = {c.kind for c in CASES}
    assert {"output directories", "resource limits", "chat data", "merge"} <= kinds


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return builders.tiny_hf(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("case", MODEL, ids=[c.name for c in MODEL])
def test_bad_model_directory_is_one_clean_line(case, tiny_dir, tmp_path, monkeypatch):
    # the case's own tiny_hf call copies the module's directory instead of building again
    monkeypatch.setattr(
        builders, "tiny_hf", lambda root, name="tiny": Path(shutil.copytree(tiny_dir, root / name))
    )
    result = run_case(case, tmp_path)
    assert result["outcome"] == "clean", result


def test_classify_tells_vague_traceback_and_silent_apart():
    case = Case("x", "k", lambda t: [], names=("--stride",))
    assert classify(case, 2, "llmopt eval: error: --stride 0 must be >= 1\n", False) == "clean"
    assert classify(case, 2, "llmopt eval: error: 0\n", False) == "vague"
    assert classify(case, 0, "", False) == "silent"
    assert classify(case, 2, "Traceback (most recent call last):\n", False) == "traceback"
    assert classify(case, None, "", True) == "traceback"
    assert classify(case, "hang", "still running after 60 s", False) == "hang"


# ---- finding 7: a cluster TOML's nodes stands unless --nodes is given ----
def _cluster_args(path: Path, *extra: str):
    return cli.build_parser("plan").parse_args(["plan", "--cluster", str(path), *extra])


def test_cluster_toml_nodes_is_not_overwritten_by_the_default(tmp_path):
    from llmopt.plan.cli.inputs import DEFAULT_NODES, build_cluster

    path = tmp_path / "c.toml"
    path.write_text('base = "dgx-h100"\nnodes = 3\n')
    assert DEFAULT_NODES != 3
    assert build_cluster(_cluster_args(path)).nodes == 3
    assert build_cluster(_cluster_args(path, "--nodes", "5")).nodes == 5


# ---- finding 9: tracebacks ----
def test_plan_estimate_tp_zero(capsys):
    code, err = run_cli(["plan", "estimate", "--tp", "0"], capsys)
    assert code == 2 and err.strip() == "llmopt plan: error: --tp=0 must be a positive integer"


def test_output_is_checked_before_any_model_is_loaded(tmp_path, capsys, monkeypatch):
    import llmopt.models.loading as loading

    def never(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(loading, "load_model", never)
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    code, err = run_cli(
        ["quantize", "--model", "smollm2-135m", "--out", str(blocker / "o")], capsys
    )
    assert code == 2 and f"{blocker} is a file" in err and err.count("\n") == 1
    assert blocker.read_text() == "keep me"


def test_unwritable_output_parent_is_refused(tmp_path, monkeypatch):
    import tempfile

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigFileError, match=r"--out .*cannot write in .*Read-only file system"):
        check_output(tmp_path / "out", "--out")


def test_full_disk_is_refused_before_work(tmp_path, monkeypatch):
    import shutil as shutil_module

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(ConfigFileError, match="has only 4096 bytes free"):
        check_output(tmp_path / "out", "--out")


def test_output_of_the_wrong_kind(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigFileError, match="is a file; it must be a directory"):
        check_output(tmp_path / "f", "--out", "dir")
    with pytest.raises(ConfigFileError, match="is a directory; it must be a file path"):
        check_output(tmp_path, "--emit", "file")
    check_output(tmp_path / "new" / "deeper", "--out", "dir")  # missing parents are fine
    assert not (tmp_path / "new").exists()  # ... and the check creates nothing


def test_ctrl_c_exits_130_quietly(capsys, monkeypatch):
    import llmopt.report.cli as report_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_cli, "run", interrupted)
    code, err = run_cli(["report", str(ROOT / "docs"), "--out", "unused.html"], capsys)
    assert code == cli.EXIT_INTERRUPTED == 130
    assert "Traceback" not in err and err.strip() == ""


def test_closed_pipe_exits_quietly(capsys, monkeypatch):
    import llmopt.report.cli as report_cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(report_cli, "run", closed)
    code, err = run_cli(["report", str(ROOT / "docs"), "--out", "unused.html"], capsys)
    assert code == cli.EXIT_PIPE_CLOSED == 0 and err == ""


def test_plan_json_into_head_is_quiet():
    cmd = [sys.executable, "-m", "llmopt", "plan", "--json", "--top-k", "100"]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


@pytest.mark.parametrize("bug", [ZeroDivisionError, ValueError, KeyError, TypeError])
def test_a_bug_still_shows_its_traceback(bug, monkeypatch, capsys):
    """Only `LlmoptError`s are input errors: a ValueError or KeyError from inside llmopt is a
    bug, shown with its traceback and a request to report it (exit 1), never a usage line."""
    import llmopt.report.cli as report_cli

    def run(args):
        raise bug("a bug, not an input error")

    monkeypatch.setattr(report_cli, "run", run)
    code, err = run_cli(["report", str(ROOT / "docs"), "--out", "unused.html"], capsys)
    assert code == cli.EXIT_BUG == 1
    assert "Traceback (most recent call last)" in err and f"{bug.__name__}: " in err
    assert "is a bug in llmopt" in err and "please report it" in err
    assert "error: a bug" not in err  # not printed as an input error


def test_an_input_error_is_one_line(monkeypatch, capsys):
    import llmopt.report.cli as report_cli
    from llmopt.errors import LlmoptError, UsageError

    def run(args):
        raise UsageError("--thing 3 must be 1 or 2")

    monkeypatch.setattr(report_cli, "run", run)
    code, err = run_cli(["report", str(ROOT / "docs"), "--out", "unused.html"], capsys)
    assert code == 2 and err == "llmopt report: error: --thing 3 must be 1 or 2\n"
    assert issubclass(UsageError, LlmoptError) and issubclass(UsageError, ValueError)


# ---- finding 10: vague messages, silently reinterpreted values, escaping paths ----
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["plan", "--gpus", "8"], "--gpus"),  # no longer --gpus-per-node
        (["plan", "estimate", "--zero", "1"], "--zero"),  # no longer --zero-stage
        (["generate", "--prompt", "x", "--max-new", "3"], "--max-new"),
        (["eval", "ppl", "--str", "4"], "--str"),
    ],
)
def test_abbreviations_are_refused(argv, flag, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2 and "error:" in err
    assert flag in err or "invalid choice" in err


def test_every_parser_refuses_abbreviations():
    seen = 0
    for command in cli.COMMANDS:
        stack = [cli.build_parser(command)]
        while stack:
            parser = stack.pop()
            seen += 1
            assert parser.allow_abbrev is False, parser.prog
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack.extend(action.choices.values())
    assert seen >= 2 * len(cli.COMMANDS)  # each command's parser and the top one, at least


def test_latest_pointer_outside_the_directory(tmp_path):
    from llmopt.train.checkpoint import latest_checkpoint

    root = tmp_path / "ckpt"
    (root / "step_000001").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "manifest.json").write_text('{"step": 1, "layout": {}}')
    (root / "latest").write_text("../elsewhere\n")
    with pytest.raises(ConfigFileError, match=r"latest: target = '\.\./elsewhere' points outside"):
        latest_checkpoint(root)
    (root / "latest").write_text("")
    with pytest.raises(ConfigFileError, match="latest is empty"):
        read_pointer(root, "latest")
    (root / "latest").write_text("step_000001")
    assert read_pointer(root, "latest") == root / "step_000001"


def test_manifest_types_and_files(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"step": "3", "layout": {}}))
    with pytest.raises(ConfigFileError, match=r"manifest.json: step = '3' must be an integer"):
        read_manifest(tmp_path)
    path.write_text(json.dumps({"step": 3, "layout": {}, "files": ["/etc/passwd"]}))
    with pytest.raises(ConfigFileError, match=r"files\[0\] = '/etc/passwd' points outside"):
        read_manifest(tmp_path)
    path.write_text(json.dumps({"step": 3}))
    with pytest.raises(ConfigFileError, match="missing required key 'layout'"):
        read_manifest(tmp_path)
    path.write_text(json.dumps({"step": 3, "layout": {"tp": 1}, "files": ["rank00000.st"]}))
    assert read_manifest(tmp_path)["step"] == 3


def test_truncated_checkpoint_shard_names_the_file(tmp_path, capsys, tiny_dir):
    import torch

    from llmopt.models.hf import SafetensorsError, iter_tensors

    directory = Path(shutil.copytree(tiny_dir, tmp_path / "m"))
    shard = directory / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SafetensorsError, match=r"m/model.safetensors \(100 bytes\) is truncated"):
        list(iter_tensors(directory, torch.float32))


# ---- issue 30 item 3: one root for every user-facing error ----
INTERNAL_ERRORS = {
    "OutOfBlocksError": "the serving engine's allocator; requests are checked against it first",
    "APIError": "an HTTP error body of the server, not a CLI error",
    "QueueFullError": "the server's 429",
    "UnavailableError": "the server's 503",
    "_Hang": "the sweep's own time limit",
    "_Captured": "control flow of GPTQ's calibration hooks",
    "_Stop": "control flow of the lm-eval adapter's stop strings",
}


def test_every_error_class_derives_from_the_root():
    """Read from the source (no imports): every exception class llmopt defines reaches
    `LlmoptError` through its bases, except the internal ones listed with the reason."""
    import ast

    bases: dict[str, list[str]] = {}
    for path in (ROOT / "llmopt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                bases.setdefault(node.name, names)
    errors = [n for n, bs in bases.items() if n.endswith("Error") or "Exception" in bs]

    def rooted(name: str, seen: frozenset = frozenset()) -> bool:
        if name == "LlmoptError":
            return True
        return name not in seen and any(rooted(b, seen | {name}) for b in bases.get(name, []))

    loose = sorted(n for n in errors if not rooted(n) and n not in INTERNAL_ERRORS)
    assert loose == [], loose
    assert len([n for n in errors if rooted(n)]) >= 58
