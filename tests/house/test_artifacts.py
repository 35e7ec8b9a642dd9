import json
import os
import stat

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


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]
)
def test_written_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        target = tmp_path / "run" / "report.json"
        atomic_write_json(target, {"ok": True})
        atomic_write(tmp_path / "run" / "w.bin", lambda tmp: tmp.write_bytes(b"\x00"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "run" / "w.bin").stat().st_mode) == file_mode
    assert stat.S_IMODE(target.parent.stat().st_mode) == dir_mode
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json", "w.bin"]
