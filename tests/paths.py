"""Paths the tests read, from one place, so a test file can move between tests/<package>/
folders without recounting `Path(__file__).parents[...]`."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root
FIXTURES = REPO / "tests" / "fixtures"  # checked-in test data (chat templates, ...)
KERNEL_CACHE = REPO / "runs" / "kernel_cache"  # built C++ kernels, shared across test runs
