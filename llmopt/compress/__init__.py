"""Model compression: weight quantization (`llmopt.compress.quant`)."""
