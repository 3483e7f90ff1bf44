"""Online weight quantization (`--quantization`): the quantized Linear, its methods, and applying them to a loaded
pipeline (docs/quantization.md). Which component gets which method is resolved by `config/quantization.py`."""
