"""benchmarks/gpu_sparse24.py without CUDA: one clear line, exit status 2, nothing written."""

import os
import subprocess
import sys

from tests.paths import REPO

ROOT = REPO


def test_exits_with_a_clear_message_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_sparse24.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_sparse24: CUDA is not available (torch.cuda.is_available() is False); "
        "this benchmark needs an NVIDIA GPU"
    )
    assert not out.exists()
