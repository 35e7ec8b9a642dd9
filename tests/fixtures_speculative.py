"""Fixtures shared by the speculative-decoding tests.

Import the functions into a test module (`from fixtures_speculative import ...`); they are
registered under their `name`, so test arguments do not shadow the imported names.
"""

import pytest
import torch

from llmopt.models import build_model


@pytest.fixture(autouse=True, scope="module", name="one_thread")
def one_thread_fixture():
    """Tiny models: thread hand-offs would cost more than the math on a shared 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(name="target")
def target_fixture(tiny_config):
    """A 4-layer tiny Llama (vocabulary 128, context 64) to decode with."""
    return build_model(tiny_config.replace(num_layers=4), seed=3).eval()
