"""The compute side's interface to its memory workers (`MemoryLink`), and `combine`,
which puts the workers' attention outputs back in packed row order.

Data in: one layer's packed q/k/v and the step's `WorkerPart`s.
Data out: o [N, Hq, Dv] in packed row order (partials of a KV split over workers merged
exactly by log-sum-exp); after the last layer, when asked, the keys the workers'
scoring policies dropped for good (`DroppedKeys`).

Implementations: `lamina.executor.local` (memory sides in this process) and
`lamina.dataplane.protocol.SocketLink` (memory workers over sockets / shared memory).
The compute side depends only on this interface, never on the data plane.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from lamina.compute.packing import WorkerPart
from lamina.engine.messages import DroppedKeys
from lamina.kernels import (
    merge_attention,
)
from lamina.memory.sparsity_config import KVOverride


class MemoryLink(ABC):
    """The compute side's view of its memory workers for one step. `submit` hands a
    micro-batch's layer q/k/v over and returns at once; `collect` waits for its output.
    Between the two the compute side runs the other micro-batches (staggered pipelining)."""

    # where q/k/v must be for `submit`: a compute GPU sends host memory workers theirs
    # through pinned buffers (`compute.device.HostStaging`)
    device = torch.device("cpu")

    def begin(self, step: int, parts: Sequence[Sequence[WorkerPart]],  # noqa: B027
              released: Sequence[int] = (), tier_orders: Sequence = (),
              overrides: Mapping[int, KVOverride] | None = None,
              report_dropped: bool = False) -> None:
        """A step's metadata, once before its layers: each micro-batch's parts, the
        sequences dropped since the last step (`StepPlan.released`), whose slot tables
        a memory end that keeps them may drop, the step's KV tier orders
        (`StepPlan.tier_orders`, each for the worker it names), the KV sparsity
        of the step's requests that chose their own ({seq id: `KVOverride`}), and
        whether the workers are to say which keys their policies dropped for good
        (`dropped`, after the last layer)."""

    def dropped(self) -> tuple[DroppedKeys, ...]:
        """After the step's last layer, when `begin` asked: the keys each worker's h2o /
        snapkv sequences left out at every layer for good, newly."""
        return ()

    @abstractmethod
    def submit(self, layer: int, mb: int, q, k, v, parts: Sequence[WorkerPart]) -> None: ...

    @abstractmethod
    def collect(self, layer: int, mb: int, parts: Sequence[WorkerPart], out_shape, dtype,
                merge: bool = False) -> torch.Tensor: ...

    def exchange(self, layer: int, mb: int, q, k, v, parts: Sequence[WorkerPart], out_shape,
                 dtype, merge: bool = False):
        """`submit` and `collect` at once, for a step with nothing to run between them:
        -> (o, seconds spent sending), or None where this link has no such path."""
        return None


def combine(parts: Sequence[WorkerPart], outs: list, out_shape, dtype, merge: bool):
    """Workers' (o [n_w, Hq, Dv], lse [n_w, Hq]) -> o [N, Hq, Dv] in packed row order.
    `merge`: some rows attended on several workers (KV split); their partials are merged
    exactly by log-sum-exp. Rows are unique within one worker's part."""
    n, hq, dv = out_shape
    # the workers' outputs' device (the compute GPU for GPU memory workers in-process)
    dev = next((r[0].device for r in outs if r is not None), torch.device("cpu"))
    if not merge:
        for p, r in zip(parts, outs):
            if p.whole:  # one worker has every row: its output is the answer
                return r[0] if r[0].dtype == dtype else r[0].to(dtype)
        o = torch.empty(n, hq, dv, dtype=dtype, device=dev)
        for p, r in zip(parts, outs):
            if r is not None and p.span:
                o[p.span[0]:p.span[1]] = r[0]
            elif r is not None:
                o.index_copy_(0, p.rows.to(dev), r[0].to(dtype))
        return o
    os, lses = [], []
    for p, r in zip(parts, outs):  # each worker's partial over all rows; absent: lse -inf
        if r is not None:
            o = torch.zeros(n, hq, dv, device=dev)
            lse = torch.full((n, hq), float("-inf"), device=dev)
            rows = p.rows.to(dev)
            o[rows], lse[rows] = r[0].float(), r[1]
            os.append(o)
            lses.append(lse)
    return merge_attention(os, lses)[0].to(dtype)
