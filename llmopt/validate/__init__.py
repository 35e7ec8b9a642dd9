"""Validation of llmopt against references and its own promises (the checks benchmarks and
tests share): each module defines one check once."""
