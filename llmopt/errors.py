"""The root of every error llmopt means for its user.

An `LlmoptError` says what in the user's input (a flag, a file, a key, a request) cannot be
used and what would be valid; `llmopt` prints it as one line and exits 2. Every other exception
that reaches the command line is a bug in llmopt: it keeps its traceback, with a request to
report it. The concrete classes keep their builtin bases too (`class ConfigFileError(LlmoptError,
ValueError)`), so callers that catch `ValueError` or `FileNotFoundError` still do.

This module imports nothing, so any module can raise from it without an import cycle.
"""

from __future__ import annotations


class LlmoptError(Exception):
    """Bad input, named: the flag, file, key or value, and what would be valid."""


class UsageError(LlmoptError, ValueError):
    """A value the command cannot use (when no more specific class fits)."""
