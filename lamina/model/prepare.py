"""The compute side's model: split, linears packed, pointwise chains fused, position
tables memoized. One recipe for the local executor (`lamina.entrypoints.llm`) and the Ray compute
worker (`lamina.cluster.compute_worker`).

Data in: a loaded HF model (`lamina.model.loader.load`). Data out: a `SplitModel` ready for
`ComputeSide`, the `DenseChoice` made for its linears, and what was fused (with why not,
where nothing was).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lamina.kernels.pointwise import pointwise_ops
from lamina.splitter import split_model
from lamina.splitter.dense import DenseChoice, pack_dense
from lamina.splitter.fuse import fuse_pointwise
from lamina.splitter.memo import memo_positions
from lamina.splitter.split import SplitModel

log = logging.getLogger("lamina.model.prepare")


@dataclass(frozen=True)
class Prepared:
    split: SplitModel
    dense: DenseChoice
    fused: dict  # {"rms_norm": n, "rope": n, "silu_mul": n}; empty if not fused
    fuse_reason: str


def prepare_split(model: torch.nn.Module, dense_backend: str = "auto", batch_hint: int = 32,
                  fuse: bool = True) -> Prepared:
    split, dense = pack_dense(split_model(model), dense_backend, batch_hint)
    fused, why = {}, "fuse_pointwise=False"
    if fuse:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        ops, why = (None, f"the weights are on {device}") if device.type != "cpu" \
            else pointwise_ops()
        if ops is not None:
            split, fused = fuse_pointwise(split, ops)
    log.info("pointwise chains fused: %s (%s)", fused or "none", why)
    split = memo_positions(split)[0]  # position tables once a step
    return Prepared(split, dense, fused, why)
