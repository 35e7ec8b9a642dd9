"""The portable build of the fused kernels (no AVX-512: the scalar loops a CPU without it runs)
computes what the native build computes: every coded format, the attention, whole steps."""

from __future__ import annotations

import os
from pathlib import Path

from tests.paths import KERNEL_CACHE

os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.infer.fast import FusedModel, build  # noqa: E402
from llmopt.infer.fast import model as fused_model  # noqa: E402
from llmopt.infer.fast.layout import projection  # noqa: E402
from tests.infer.test_fused_forward import STEPS, EagerSeqs, PagedCache, tiny_model  # noqa: E402
from tests.models.test_packed_gguf import TYPES, packed_linear  # noqa: E402

pytestmark = pytest.mark.slow  # the module fixture builds the portable kernels (~95 s on 2 cores)


@pytest.fixture(scope="module")
def portable():
    module = build.load_portable_kernels()
    native = build.load_kernels()
    assert native is not None, build.build_error()
    assert not module.HAS_AVX512_VNNI and native.HAS_AVX512_VNNI == _has_avx512()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield module, native
    torch.set_num_threads(before)


def _has_avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


@pytest.mark.parametrize("kind", TYPES)
def test_coded_formats_agree_with_the_native_build(portable, kind):
    module, native = portable
    layer = packed_linear(kind, 40, 512, seed=2)
    (kw,) = projection([layer], "test")
    x = torch.randn(9, 512)
    got, want = kw.to_cpp(module)(x), kw.to_cpp(native)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(kw.to_cpp(module).row(17), kw.to_cpp(native).row(17))


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3"])
def test_whole_steps_match_eager(portable, name, monkeypatch):
    module, _ = portable
    monkeypatch.setattr(fused_model, "load_kernels", lambda: module)
    model = tiny_model(name)
    fused = FusedModel(model)
    paged, eager = PagedCache(fused), EagerSeqs(model)
    for chunks in STEPS:
        torch.testing.assert_close(paged.run(fused, chunks), eager.run(chunks), rtol=0, atol=1e-4)
