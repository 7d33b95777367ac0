"""lamina.splitter: cut an HF decoder LLM into n+1 slices at its n attention operators.

    from lamina.splitter import split_model
    sm = split_model(model)        # trace (torch.export) + min cuts + slices
    sm.slices, sm.attention_specs, sm.context_bytes_per_token, sm.run_local(ids)
"""
from .attention_op import UnsupportedAttentionError, reference_attention
from .graph import DataflowGraph, build_graph
from .partition import Partition, decide_partition
from .slices import Slice, build_slices
from .split import AttentionSpec, LocalKVCache, SplitModel, split_model
from .trace import SplitError, trace

__all__ = [
    "AttentionSpec", "DataflowGraph", "LocalKVCache", "Partition", "Slice", "SplitError",
    "SplitModel", "UnsupportedAttentionError", "build_graph", "build_slices",
    "decide_partition", "reference_attention", "split_model", "trace",
]
