"""The error of model configurations, in its own module so config readers share it without cycles."""

from __future__ import annotations

from llmopt.errors import LlmoptError


class ConfigError(LlmoptError, ValueError):
    """A model configuration that cannot describe a working model."""
