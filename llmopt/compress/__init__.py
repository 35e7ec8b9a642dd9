"""llmopt.compress: weight quantization (RTN, AWQ, GPTQ), pruning and distillation.

The formats these write (packed INT-n linears, packed N:M sparsity, their directories) are
defined beside the model, in `llmopt.models.packed`, which `load_model` reads without
importing this package.
"""
