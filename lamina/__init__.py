"""Lamina: LLM inference with attention offloaded to memory workers.

`from lamina import LLM, SamplingParams, BeamSearchParams, StructuredOutputs, TokensPrompt`
(imported lazily, so `lamina.memory.allocator` and friends stay light);
`lamina.connect()` returns a client of the cluster's running Lamina service
(lamina.cluster.client, found by name: only lamina.cluster imports ray).
"""
import importlib
import os

# oneDNN keeps state per input shape (torch's ideep LRU cache and oneDNN's primitive
# cache, 1024 entries each by default, ~2 MB an entry for SmolLM2's linears): a server
# seeing many prompt lengths grew by GBs. 128 entries bound it (measured: RSS flat after
# 400 mixed-length prefills at 64, +0.9 GB at the defaults after 1000). Read when
# oneDNN first runs, so set here, before any linear; a value already set is kept.
ONEDNN_CACHE = "128"
for _var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_var, ONEDNN_CACHE)

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "StructuredOutputs", "TokensPrompt",
           "connect"]


def connect(address=None, service="lamina"):
    """A client of the Lamina service `service` (`lamina up`) on the Ray cluster at
    `address` ($RAY_ADDRESS, else the cluster this node belongs to): `submit`,
    `generate`, `abort`, `status`. See lamina.cluster.client."""
    return importlib.import_module("lamina.cluster.client").connect(address, service)


def __getattr__(name):
    if name == "LLM":
        from lamina.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from lamina.sampling.params import SamplingParams
        return SamplingParams
    if name == "BeamSearchParams":
        from lamina.engine.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "TokensPrompt":
        from lamina.engine.inputs import TokensPrompt
        return TokensPrompt
    if name == "StructuredOutputs":
        from lamina.sampling.structured import StructuredOutputs
        return StructuredOutputs
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
