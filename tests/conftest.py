import os

import pytest
import torch

# Two cores: processes spawned by tests inherit one OpenMP thread each, so multi-process tests
# do not thrash (this process's own torch thread count is already fixed at import).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from llmopt.models import ModelConfig, build_model  # noqa: E402
from llmopt.models.loading import load_tokenizer  # noqa: E402
from llmopt.models.tokenizer import Tokenizer  # noqa: E402
from tests.tiny_models import save_model_dir, smol_config, tiny_gqa_config  # noqa: E402


@pytest.fixture
def tiny_config() -> ModelConfig:
    """A small GQA Llama config whose dims every TP degree up to 4 divides."""
    return tiny_gqa_config()


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    return build_model(tiny_config, seed=0).eval()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytest.mark.usefixtures("one_thread")`): on a shared
    2-core machine tiny models' parallel regions wait on descheduled threads; results do not
    depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's real tokenizer, read once per session (it is only read, never changed)."""
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, smollm2_tokenizer):
    """Factory `tiny_hf_dir(name, seed=0, **overrides) -> Path`: a random model over SmolLM2's
    vocabulary (tests/tiny_models.py's base config with `overrides`) saved HF-style with the
    real tokenizer. Each distinct call is built once per session; callers only read it."""
    built: dict[tuple, object] = {}

    def make(name: str, seed: int = 0, **overrides):
        key = (name, seed, tuple(sorted(overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"hf-{name}") / "model"
            built[key] = save_model_dir(
                path, smol_config(name, **overrides), seed, smollm2_tokenizer
            )
        return built[key]

    return make


# Hypothesis budgets (tests/house/test_fuzz_*.py): the default keeps the fuzz suite within CI's
# minutes on 2 cores; `pytest --hypothesis-profile llmopt-long tests/house/test_fuzz_*.py` digs deeper.
from hypothesis import HealthCheck, settings  # noqa: E402

_FUZZ = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("llmopt-ci", max_examples=60, derandomize=True, **_FUZZ)
settings.register_profile("llmopt-long", max_examples=2000, **_FUZZ)
settings.load_profile("llmopt-ci")
