"""A model's tensors under its own names, without its code: what a split from a stored
trace needs, built without importing transformers.

Data in: `{name: tensor}` (the names the model's `named_parameters` / `named_buffers`
give, tied tensors as one object under each name), the names that are parameters, the
model's config as a plain mapping, the `CachedTrace` of that model, and `facts` read
off the model when it was loaded in full (e.g. {"rotary": its rotary frequencies}).
Data out: `WeightsOnlyModel`, an `nn.Module` whose attribute paths are the model's
(`model.layers.0.self_attn.q_proj.weight`), so `trace()` rebinds the stored graph to
it as it would to the model itself. It has no `forward`: anything that must run the
model (calibration) loads the model.

Why: a compute worker (and its replacement after a failure) otherwise imports
transformers and builds the model only to hand its tensors to the stored graph; that
import is most of the worker's start (`benchmarks/start_probe.py`).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .trace_store import CachedTrace


class ModelConfigView(SimpleNamespace):
    """A config's fields as attributes (missing ones read as None, as `getattr(config,
    name, None)` does on an HF config)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class WeightsOnlyModel(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], parameters: set[str], config: dict,
                 cached_trace: CachedTrace, facts: dict | None = None):
        super().__init__()
        self.config = ModelConfigView(**config)
        self.cached_trace = cached_trace
        self.facts = dict(facts or {})
        made: dict[int, torch.nn.Parameter] = {}  # tied tensors stay one object
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            if name in parameters:
                if id(t) not in made:
                    made[id(t)] = torch.nn.Parameter(t, requires_grad=False)
                mod.register_parameter(leaf, made[id(t)])
            else:
                mod.register_buffer(leaf, t)
        self.eval()

    def forward(self, *args, **kwargs):
        raise NotImplementedError(
            "a WeightsOnlyModel holds a model's tensors for its stored trace; load the "
            "model itself to run it")
