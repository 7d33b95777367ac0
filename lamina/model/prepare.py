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

from lamina.compute.device import check_device, move_split
from lamina.kernels.pointwise import pointwise_ops
from lamina.splitter import split_model
from lamina.splitter.dense import DenseChoice, pack_dense, select_dense_backend
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
                  fuse: bool = True, device: str = "cpu") -> Prepared:
    """Split on the CPU (where the model was loaded), then, for a GPU `device`, move
    the model and the slices there: eager linears (cuBLAS), no CPU-fused chains."""
    dev = check_device(device)
    if dev.type == "cpu":
        split, dense = pack_dense(split_model(model), dense_backend, batch_hint)
    else:  # "auto" -> eager there; "onednn" is refused naming the device
        dtype = next(model.parameters()).dtype
        split, dense = split_model(model), select_dense_backend(dense_backend, dtype, dev)
    fused, why = {}, "fuse_pointwise=False"
    if fuse:
        ops, why = (None, f"the slices run on {dev}") if dev.type != "cpu" \
            else pointwise_ops()
        if ops is not None:
            split, fused = fuse_pointwise(split, ops)
    log.info("pointwise chains fused: %s (%s)", fused or "none", why)
    split = memo_positions(split)[0]  # position tables once a step
    if dev.type != "cpu":
        model.to(dev)  # its buffers; the parameters are the slices' own, moved below
        move_split(split, dev)
    return Prepared(split, dense, fused, why)


def rotary_frequencies(model) -> tuple[float, ...] | None:
    """The model's rotary inverse frequencies (HF's `rotary_emb.inv_freq`, scaling
    applied), or None when its positions are not rotary or depend on the length
    (dynamic scaling: a key's rotation then changes with the context)."""
    for mod in model.modules():
        inv = getattr(mod, "inv_freq", None)
        if inv is not None and "Rotary" in type(mod).__name__:
            if "dynamic" in str(getattr(mod, "rope_type", "")):
                return None
            return tuple(float(x) for x in inv.flatten())
    return None
