"""GGUF export for llama.cpp, Ollama and LM Studio (see `export` for what each module does)."""

from llmopt.export.gguf.export import GGUF_TYPES, export_gguf

__all__ = ["GGUF_TYPES", "export_gguf"]
