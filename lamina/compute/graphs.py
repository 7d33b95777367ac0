"""Decode slices replayed as CUDA graphs, one set per batch-size bucket.

Data in: the split's slices and, per decode step, its N tokens' ids and positions and,
per layer, the attention output o [N, Hq, Dv] from the memory side.
Data out: each slice's outputs, as the eager slices give them, cut to the step's N rows
(q [1, Hq, N, D], k/v [1, Hkv, N, D], logits [1, N, V]; the context tensors passed from
slice to slice stay at the bucket's size, since only the next slice reads them).

Why CUDA graphs captured per slice (not `torch.compile`): a decode slice of SmolLM2 is
~20-30 small kernels, and at batch 32 launching them costs more than running them; a
graph replays them in one launch. The slices must stay separate graphs (attention on
the memory side runs between them, on other devices), and every op in a slice is per
token, so a step of N tokens runs on the next bucket's static buffers with the padding
rows computing harmless garbage that nobody reads. `torch.compile(mode="reduce-overhead")`
would do the same capture behind guards and recompile per shape, plus a compile of each
of the 31 slices on every start; plain capture of the already-exported aten graphs is
exact: the same kernels eager runs.

Buckets are captured lazily, the first time a step of that size runs, all sharing one
memory pool (graphs replay one at a time on one stream; what outlives a replay, the
static outputs and position tables, is held here, so no capture reuses it). The
position tables (`splitter.memo`) are computed inside the first slice's graph and read by
the others, so the runner clears that cache before a capture and holds the captured
tables for as long as the graphs live.

A slice that synchronizes with the host (a data-dependent op such as transformers'
grouped-MoE fallback, which reads expert counts with `.tolist()`) cannot be captured: the
warm-up run before each capture runs under torch's sync debug mode, and the first such
slice turns graphs off for good (`disabled` says why); that step finishes eagerly on the
bucket's buffers and later steps run eager.

`emulate=True` runs the same bookkeeping (static buffers, padding, row cuts) with eager
slices and no capture: how the CPU tests check it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from lamina.splitter.memo import PositionTables

log = logging.getLogger("lamina.compute.graphs")


def buckets(max_tokens: int) -> tuple[int, ...]:
    """Captured batch sizes up to `max_tokens`: 1, 2, 4, 8, then every 16 (as vLLM's
    1, 2, 4 and steps of 8, coarser: fewer captures, <= 15 padding rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = [b for b in (1, 2, 4, 8) if b < max_tokens]
    out += list(range(16, max_tokens, 16))
    return tuple(sorted(set(out + [max_tokens])))


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n tokens; None if none does (the step runs eager)."""
    return next((b for b in sizes if b >= n), None)


@dataclass
class _Bucket:
    size: int
    ids: torch.Tensor  # [1, size] int64
    pos: torch.Tensor  # [1, size] int64
    attn: torch.Tensor | None = None  # [1, size, Hq, Dv]: the layer's o, padded
    outs: list = field(default_factory=list)  # per slice: its (static) outputs
    graphs: list = field(default_factory=list)  # per slice: a CUDAGraph ([] emulated)
    tables: list = field(default_factory=list)  # position tables the graphs read


class SliceGraphs:
    """The split's slices behind per-bucket static buffers (graphs on CUDA)."""

    def __init__(self, slices, device: torch.device, max_tokens: int, emulate: bool = False):
        if not emulate and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.slices, self.device, self.emulate = slices, device, emulate
        self.sizes = buckets(max_tokens)
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._caches = {id(m.cache): m.cache for s in slices for m in s.module.modules()
                        if isinstance(m, PositionTables)}
        self.captures = 0  # buckets captured so far
        self.disabled: str | None = None  # why graphs are off (a slice syncs), or None
        self.bucket: _Bucket | None = None  # the step in flight's

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> bool:
        """A step of ids/positions [1, N]: -> False if no bucket holds N (run eager)."""
        n = input_ids.shape[1]
        size = bucket_for(n, self.sizes)
        if size is None or self.disabled:
            self.bucket = None
            return False
        b = self._buckets.get(size)
        if b is None:
            b = self._buckets[size] = _Bucket(
                size, torch.zeros(1, size, dtype=torch.int64, device=self.device),
                torch.zeros(1, size, dtype=torch.int64, device=self.device))
        b.ids[:, :n].copy_(input_ids, non_blocking=True)
        b.pos[:, :n].copy_(positions, non_blocking=True)
        b.ids[:, n:].zero_()
        b.pos[:, n:].zero_()
        self.bucket, self.n = b, n
        return True

    def run(self, i: int, attn_out: torch.Tensor | None) -> tuple:
        """Slice i of the step begun: attn_out [N, Hq, Dv] (None for slice 0) -> its
        outputs, q/k/v and logits cut to the step's N rows."""
        b, n = self.bucket, self.n
        assert b is not None
        if attn_out is not None:
            if b.attn is None:
                b.attn = torch.zeros(1, b.size, *attn_out.shape[1:], dtype=attn_out.dtype,
                                     device=self.device)
            b.attn[0, :n].copy_(attn_out)
        if len(b.outs) <= i:  # first run of this bucket: record slice i
            self._record(b, i)
        elif self.emulate or self.disabled:
            b.outs[i] = self.slices[i](*self._inputs(b, i))
        else:
            b.graphs[i].replay()
        out = b.outs[i]
        if i == len(self.slices) - 1:
            return (out[0][:, :n],)
        return (out[0][:, :, :n], out[1][:, :, :n], out[2][:, :, :n], *out[3:])

    def _inputs(self, b: _Bucket, i: int) -> tuple:
        return (b.ids, b.pos) if i == 0 else (b.pos, b.attn, *b.outs[i - 1][3:])

    def _record(self, b: _Bucket, i: int) -> None:
        """Slice i's graph for bucket b (its inputs are the buffers and slice i-1's static
        outputs); emulated: just its eager outputs."""
        args = self._inputs(b, i)
        if not self.emulate and not self.disabled:
            self._warm_up(i, args)
        if self.emulate or self.disabled:
            b.outs.append(self.slices[i](*args))
            return
        if i == 0:
            for c in self._caches.values():
                c.clear()  # the tables are computed inside slice 0's graph
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self.slices[i](*args)
        g.replay()  # the capture ran nothing: this step's outputs
        b.graphs.append(g)
        b.outs.append(out)
        if i == 0:  # slice 0's tables: live as long as the graphs reading them
            b.tables = [v for c in self._caches.values() for v in c.values()]
        if i == len(self.slices) - 1:
            self.captures += 1

    def _warm_up(self, i: int, args: tuple) -> None:
        """Slice i once outside the capture (lazy inits), on a side stream, with host
        syncs made errors: a slice that syncs sets `disabled` instead of being captured."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):
                torch.cuda.set_sync_debug_mode("error")
                self.slices[i](*args)
        except RuntimeError as e:
            self.disabled = (f"slice {i} synchronizes with the host, so it cannot be "
                             f"captured: {str(e).splitlines()[0]}")
            log.warning("CUDA graphs off: %s", self.disabled)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream(self.device).wait_stream(side)
