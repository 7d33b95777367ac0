"""Loading a model from local files (GGUF or HF folder) and preparing its split: slices,
dense backend, fused pointwise ops.
"""
