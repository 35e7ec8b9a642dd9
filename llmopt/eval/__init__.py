"""Evaluation on real text: sliding-window perplexity and KL divergence."""
