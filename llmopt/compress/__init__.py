"""llmopt.compress: weight quantization (RTN, AWQ, GPTQ), pruning, and their file formats.

Importing the package registers the quantized and pruned directory formats with `load_model`
(`llmopt.models.loading` never imports this package).
"""

from llmopt.models.directory_formats import register_directory_format, register_quantization_method

QUANT_MARKER = "llmopt_quant.json"  # also `llmopt.compress.quant.io.MARKER`

register_directory_format("quant", QUANT_MARKER, "llmopt.compress.quant.io:load_quantized_model")
register_directory_format("prune", "llmopt_prune.json", "llmopt.compress.prune.io:load_pruned")
for _method in ("awq", "gptq"):  # HF directories with an AWQ/GPTQ quantization_config
    register_quantization_method(_method, "llmopt.compress.quant.imports:load_hf_quantized")
