"""Fixtures shared by the speculative-decoding tests.

Import the functions into a test module (`from fixtures_speculative import ...`); they are
registered under their `name`, so test arguments do not shadow the imported names.
"""

import pytest

from llmopt.models import build_model


@pytest.fixture(autouse=True, scope="module", name="_speculative_one_thread")
def one_thread_fixture(one_thread):
    """Tiny models: thread hand-offs would cost more than the math on a shared 2-core box
    (conftest's `one_thread`, for every test of the importing module)."""


@pytest.fixture(name="target")
def target_fixture(tiny_config):
    """A 4-layer tiny Llama (vocabulary 128, context 64) to decode with."""
    return build_model(tiny_config.replace(num_layers=4), seed=3).eval()
