"""llmopt: plan, apply and measure the optimizations that make LLMs cheap to train and fast to serve."""

# Registers the model-directory formats of subpackages (no torch import): `load_model` reads
# quantized directories without llmopt.models importing llmopt.compress.
from llmopt import compress as _compress  # noqa: F401

__version__ = "0.1.0"
