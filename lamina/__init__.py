"""Lamina: LLM inference with attention offloaded to memory workers."""
__version__ = "0.1.0"
