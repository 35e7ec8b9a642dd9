"""llmopt: plan, apply and measure the optimizations that make LLMs cheap to train and fast to serve."""

__version__ = "0.1.0"
