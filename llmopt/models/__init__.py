"""Plain PyTorch models, their configs and architecture presets."""

from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.llama import KVCache, Transformer, build_model
from llmopt.models.presets import PRESETS, get_preset

__all__ = [
    "PRESETS",
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "build_model",
    "get_preset",
]
