"""llama-cpp-python for the llama.cpp comparisons: a one-line exit when it is missing, and a way
to load models without llama.cpp's extra CPU buffer types.

Why the switch: on the development VM (a Firecracker guest that advertises amx_tile/amx_int8),
llama.cpp's AMX matmul dies with SIGILL on its first `tilezero` (checked with gdb in
`ggml_backend_amx_mul_mat`), so every eval crashes the process. `use_extra_bufts = False` (a
llama_model_params field, llama.cpp's `--no-extra-bufts`) keeps weights in plain CPU buffers:
no AMX and no runtime weight repacking. Pass --llamacpp-extra-bufts where AMX works.

Run as a script, it starts `llama_cpp.server` with the same switch applied:

    python benchmarks/_llamacpp.py [--extra-bufts] -- --model F.gguf --port 8001 ...
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


def require_llama_cpp(what: str = "llama_cpp") -> ModuleType:
    """The imported module, or exit with one line saying llama-cpp-python is not installed."""
    import importlib

    try:
        return importlib.import_module(what)
    except ImportError as exc:
        raise SystemExit(f"llama-cpp-python is not installed ({exc}); it is not a CI dependency: "
                         "pip install -c constraints.txt 'llama-cpp-python[server]'") from None  # fmt: skip


def set_extra_buffers(enabled: bool) -> None:
    """Make every `Llama(...)` created afterwards use (or not) llama.cpp's extra buffer types."""
    import llama_cpp.llama_cpp as capi

    current = capi.llama_model_default_params
    original = getattr(current, "llmopt_original", current)  # (ctypes' __wrapped__ is a stub)

    def default_params():  # noqa: ANN202 (a ctypes struct)
        params = original()
        params.use_extra_bufts = enabled
        return params

    default_params.llmopt_original = original  # type: ignore[attr-defined]
    capi.llama_model_default_params = default_params


def last_logits(llm: Any) -> Any:
    """Logits [vocab] of the last evaluated token (a copy). `Llama.scores` is not filled unless
    the model was created with logits_all=True (llama-cpp-python 0.3.36 samples natively)."""
    import llama_cpp
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def main(argv: list[str]) -> None:
    import runpy

    extra = "--extra-bufts" in argv[: argv.index("--")] if "--" in argv else False
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else argv
    require_llama_cpp("llama_cpp.server")
    set_extra_buffers(extra)
    sys.argv = ["llama_cpp.server", *server_args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])


def llama_bench_binary(explicit: str | None) -> str:
    """Path of llama.cpp's `llama-bench` (explicit, $LLAMA_BENCH, or on PATH), or exit with one
    line saying how to build it."""
    import os
    import shutil

    path = explicit or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    if not path or not os.access(path, os.X_OK):
        raise SystemExit(
            f"llama-bench not found ({path or 'not on PATH'}); build it from llama.cpp's source "
            "(cmake -B build && cmake --build build --target llama-bench) and pass --llama-bench"
        )
    return path


def llama_bench(
    binary: str, model: str, threads: int, *, n_prompt: int, n_gen: int, depth: int = 0,
    repetitions: int = 1, repack: bool = False, timeout: float = 900,
) -> list[dict[str, Any]]:  # fmt: skip
    """llama-bench's JSON records (one per test: pp<n_prompt>, tg<n_gen>). `repack=False`
    (`--repack 0`) keeps llama.cpp off its AMX/repacked CPU paths, which die with SIGILL on
    the development VMs."""
    import json
    import subprocess

    cmd = [
        binary, "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
        "-d", str(depth), "-r", str(repetitions), "--repack", "1" if repack else "0",
        "-o", "json",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"llama-bench failed (exit {done.returncode}): {' | '.join(tail)}")
    return json.loads(done.stdout)
