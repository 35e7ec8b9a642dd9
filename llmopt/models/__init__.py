"""Plain PyTorch models, their configs, specs and architecture presets.

Attributes are imported on first use (PEP 562), so `from llmopt.models.config import ...` in the
planner never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ConfigError": "llmopt.models.config",
    "ModelConfig": "llmopt.models.config",
    "KVCache": "llmopt.models.llama",
    "Transformer": "llmopt.models.llama",
    "build_model": "llmopt.models.llama",
    "PRESETS": "llmopt.models.presets",
    "get_preset": "llmopt.models.presets",
    "ModelSpec": "llmopt.models.spec",
    "get_spec": "llmopt.models.spec",
    "register_spec": "llmopt.models.spec",
    "registered_architectures": "llmopt.models.spec",
    "spec_for": "llmopt.models.spec",
    "spec_for_gguf": "llmopt.models.spec",
    "spec_for_hf": "llmopt.models.spec",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'llmopt.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
