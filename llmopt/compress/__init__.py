"""llmopt.compress: weight quantization (RTN, AWQ, GPTQ) and its file formats.

Importing the package registers the quantized-directory format with `load_model`
(`llmopt.models.loading` never imports this package).
"""

from llmopt.models.directory_formats import register_directory_format

QUANT_MARKER = "llmopt_quant.json"  # also `llmopt.compress.quant.io.MARKER`

register_directory_format("quant", QUANT_MARKER, "llmopt.compress.quant.io:load_quantized_model")
