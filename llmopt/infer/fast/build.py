"""Build (once, into a cache directory) and load the C++ decode kernels.

The extension is compiled with `torch.utils.cpp_extension` for this machine's CPU
(`-march=native`: AVX-512/VNNI where present, portable scalar loops otherwise) the first time
it is needed; later processes load the cached build in milliseconds. Without a compiler, or if
the build fails, `load_kernels()` returns None and the reason is kept in `build_error()`, so
callers fall back to the eager path instead of failing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
import warnings
from pathlib import Path
from types import ModuleType

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = (
    "bindings.cpp",
    "model.cpp",
    "step.cpp",
    "attention.cpp",
    "coded.cpp",
    "coded_linear.cpp",
    "dense.cpp",
    "math.cpp",
    "parallel.cpp",
)
_STATE: dict[str, object] = {}


def cache_dir() -> Path:
    """$LLMOPT_KERNEL_CACHE, else ~/.cache/llmopt/kernels."""
    root = os.environ.get("LLMOPT_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "llmopt" / "kernels"


def _build_name(portable: bool = False) -> str:
    """Hash of the source, torch version and CPU, so a change rebuilds instead of reusing."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(KERNELS.glob("*.[ch]*")):  # every source and header
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(f"{torch.__version__}|{platform.machine()}|{_cpu_flags()}".encode())
    return f"llmopt_fused{'_portable' if portable else ''}_{digest.hexdigest()[:12]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def load_kernels(verbose: bool = False) -> ModuleType | None:
    """The compiled extension, or None (see `build_error()`) when it cannot be built."""
    if "module" in _STATE:
        return _STATE["module"]  # type: ignore[return-value]
    if os.environ.get("LLMOPT_NO_KERNELS"):
        _STATE["module"], _STATE["error"] = None, "disabled by LLMOPT_NO_KERNELS"
        return None
    module = None
    try:
        module = _compile(portable=False, verbose=verbose)
        _STATE["error"] = None
    except Exception as exc:  # no compiler, no headers, build error: fall back, remember why
        first = str(exc).strip().splitlines()
        _STATE["error"] = f"{type(exc).__name__}: {first[0] if first else ''}"
    _STATE["module"] = module
    return module


def load_portable_kernels(verbose: bool = False) -> ModuleType:
    """The same kernels built for any x86-64 (no AVX-512: the scalar loops), to test the
    fallback on a machine that has AVX-512. Raises if the build fails."""
    return _compile(portable=True, verbose=verbose)


def _compile(portable: bool, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    name = _build_name(portable)
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build)
    arch = "-march=x86-64-v2" if portable and platform.machine() == "x86_64" else "-march=native"
    return cpp_extension.load(
        name=name,
        sources=[str(KERNELS / source) for source in SOURCES],
        build_directory=str(build),
        extra_cflags=["-O3", arch, "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


STALE_LOCK_S = 900.0  # a build takes 1-3 minutes; a lock this old belongs to a killed one


def _clear_stale_lock(build: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock left by a build that was killed (Ctrl-C, a timeout): its
    `FileBaton` would make every later load wait forever, silently. True if one was removed."""
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    warnings.warn(
        f"removing a stale kernel build lock ({age / 60:.0f} min old) left by a killed build: "
        f"{lock}",
        stacklevel=3,
    )
    lock.unlink(missing_ok=True)
    return True


def build_error() -> str | None:
    """Why `load_kernels()` returned None (None when it loaded or was not tried)."""
    return _STATE.get("error")  # type: ignore[return-value]
