"""Rotational staggered pipelining over compute worker processes (paper 5.1): which
slices a replica runs, and the context that moves between replicas.

Data in: a replica's place in the ring (index r of R model replicas) and a step's
slice and micro-batch counts. Data out: its tasks in order (`Ring.tasks`); each
micro-batch's `Context` after a slice, handed to the replica that runs the next one
through a `ContextLink` (over the data plane: `lamina.dataplane.migration`).

Slice k of micro-batch j runs on replica (j + k) mod R, so a micro-batch's consecutive
slices run on consecutive replicas (r, then r + 1 mod R). Each replica therefore
receives every context it needs from replica r - 1 and sends every context it makes to
r + 1, and the memory workers send layer k's attention output to the replica running
slice k + 1: every link between two processes carries its frames in the replicas' task
order (slice k, then micro-batch j), so each is a plain FIFO.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    """A micro-batch between two slices: what the next slice needs besides its attention
    output, which the memory workers send to the same replica."""

    layer: int  # the slice that made it (and the attention layer whose output follows)
    mb: int  # the micro-batch, by its index in the step
    attn_shape: tuple[int, int, int]  # (N, Hq, Dv) of that layer's attention output
    dtype: torch.dtype  # that output's dtype
    tensors: tuple  # the splitter's context tensors after the slice (None where absent)
    own: torch.Tensor | None = None  # its local prompts' attention output [n, Hq, Dv]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.tensors, self.own) if isinstance(t, torch.Tensor))


class ContextLink(ABC):
    """A replica's two ring neighbours: contexts go to the next, come from the previous."""

    @abstractmethod
    def send(self, step: int, ctx: Context) -> None: ...

    @abstractmethod
    def recv(self, step: int, layer: int, mb: int) -> Context:
        """The context of (`layer`, `mb`) from the previous replica; a frame for any other
        raises (the two ends left the rule)."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the link holds (threads, not its channels)."""


@dataclass(frozen=True)
class Ring:
    """This process's place in a ring of `size` compute replicas."""

    index: int
    size: int
    link: ContextLink

    def __post_init__(self):
        if not (isinstance(self.size, int) and self.size >= 2):
            raise ValueError(f"a ring needs >= 2 replicas, got size {self.size!r}")
        if not (isinstance(self.index, int) and 0 <= self.index < self.size):
            raise ValueError(f"ring index must be in 0..{self.size - 1}, got {self.index!r}")

    def replica(self, k: int, j: int) -> int:
        """The replica that runs slice k of micro-batch j."""
        return (k + j) % self.size

    def tasks(self, slices: int, micro_batches: int) -> list[tuple[int, int]]:
        """This replica's (slice, micro-batch) pairs of a step, in the order it runs them
        (slice, then micro-batch: the paper's staggered order)."""
        return [(k, j) for k in range(slices) for j in range(micro_batches)
                if self.replica(k, j) == self.index]

    def samples(self, slices: int, j: int) -> bool:
        """Whether micro-batch j's last slice (and so its sampling) runs here."""
        return self.replica(slices - 1, j) == self.index
