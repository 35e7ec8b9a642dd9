import json

import pytest

from llmopt.artifacts import atomic_write, atomic_write_json


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "manifest.json"
    atomic_write_json(target, {"step": 1})

    def crash(tmp):
        tmp.write_text('{"step": ')  # half a file, then the writer dies
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash)
    assert json.loads(target.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_creates_missing_parent_directories(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    atomic_write_json(target, [1, 2])
    assert json.loads(target.read_text()) == [1, 2]
