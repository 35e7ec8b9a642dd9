"""llmopt.compress: weight quantization (RTN, AWQ, GPTQ) and its file formats.

Importing the package registers the quantized-directory format with `load_model`
(`llmopt.models.loading` never imports this package).
"""

from llmopt.models.directory_formats import register_directory_format, register_quantization_method

QUANT_MARKER = "llmopt_quant.json"  # also `llmopt.compress.quant.io.MARKER`

register_directory_format("quant", QUANT_MARKER, "llmopt.compress.quant.io:load_quantized_model")
for _method in ("awq", "gptq"):  # HF directories with an AWQ/GPTQ quantization_config
    register_quantization_method(_method, "llmopt.compress.quant.imports:load_hf_quantized")
