"""Lamina: LLM inference with attention offloaded to memory workers.

`from lamina import LLM, SamplingParams` (imported lazily, so `lamina.kv_allocator` and
friends stay light).
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
