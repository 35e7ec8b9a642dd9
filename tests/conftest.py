import os

import pytest
import torch

# Two cores: processes spawned by tests inherit one OpenMP thread each, so multi-process tests
# do not thrash (this process's own torch thread count is already fixed at import).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from llmopt.models import ModelConfig, build_model  # noqa: E402


@pytest.fixture
def tiny_config() -> ModelConfig:
    """A small GQA Llama config whose dims every TP degree up to 4 divides."""
    return ModelConfig(
        name="tiny",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=64,
        rope_theta=10000.0,
    )


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    return build_model(tiny_config, seed=0).eval()


# Hypothesis budgets (tests/test_fuzz_*.py): the default keeps the fuzz suite within CI's
# minutes on 2 cores; `pytest --hypothesis-profile llmopt-long tests/test_fuzz_*.py` digs deeper.
from hypothesis import HealthCheck, settings  # noqa: E402

_FUZZ = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("llmopt-ci", max_examples=60, derandomize=True, **_FUZZ)
settings.register_profile("llmopt-long", max_examples=2000, **_FUZZ)
settings.load_profile("llmopt-ci")
