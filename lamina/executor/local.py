"""`LocalExecutor`: the compute side and its memory sides in this one process.

Data in: `StepPlan`. Data out: `StepResult`. Attention runs inside `submit` (no
overlap); the same `ComputeSide` runs in `lamina.cluster`'s Ray compute worker, where the
memory link is the data plane instead.
"""
from __future__ import annotations

import time

import torch

from lamina.compute.compute_side import ComputeSide
from lamina.compute.memory_link import MemoryLink, combine
from lamina.compute.packing import WorkerPart
from lamina.engine.messages import DroppedKeys, StepPlan, StepResult
from lamina.executor.base import Executor
from lamina.memory.memory_side import MemorySide
from lamina.memory.tier_orders import TierMiss, sum_stats
from lamina.splitter.split import SplitModel
from lamina.trace import Span, Tracer


class _LocalLink(MemoryLink):
    """Memory sides in this process: attention runs inside `submit` (no overlap)."""

    def __init__(self, memory: list[MemorySide], params):
        self.memory, self.params = memory, params
        devices = {m.device for m in memory}
        # memory sides on one GPU take a GPU compute side's q/k/v as they are
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self.ready: dict[tuple[int, int], list] = {}
        self.report = False  # this step's `report_dropped`
        self.tracers = [Tracer(f"memory{w}") for w in range(len(memory))]

    def begin(self, step, parts, released=(), tier_orders=(), overrides=None,
              report_dropped=False):
        # in-process: whole SlotBatches
        self.report = report_dropped
        for tr in self.tracers:
            tr.step = step
        if tier_orders:
            apply_tiers(self.memory, tier_orders)
        if released:
            for mem in self.memory:
                mem.release(released)
        if overrides:
            for mem in self.memory:
                mem.override(overrides)
        for mb in parts:
            for mem, p in zip(self.memory, mb):
                if p.active:
                    mem.check(p.new_slots, p.batch, p.seq_ids)

    def submit(self, layer, mb, q, k, v, parts):
        self.ready[layer, mb] = [self._attend(w, layer, mb, q, k, v, p) if p.active else None
                                 for w, p in enumerate(parts)]

    def _attend(self, w: int, layer: int, mb: int, q, k, v, p: WorkerPart):
        t = time.perf_counter()
        wq, wk, wv = p.take(q, k, v)
        out = self.memory[w].attend(layer, self.params[layer], wq, wk, wv, p.new_slots,
                                    p.batch, checked=True, seq_ids=p.seq_ids)
        self.tracers[w].record("attend", layer, t, mb=mb)
        return out

    def collect(self, layer, mb, parts, out_shape, dtype, merge=False):
        return combine(parts, self.ready.pop((layer, mb)), out_shape, dtype, merge)

    def dropped(self) -> tuple[DroppedKeys, ...]:
        if not self.report:
            return ()
        return tuple(DroppedKeys(sid, w, tuple(slots.tolist()))
                     for w, mem in enumerate(self.memory)
                     for sid, slots in sorted(mem.take_dropped().items()))


class LocalExecutor(Executor):
    def __init__(self, split: SplitModel, memory: MemorySide | list[MemorySide],
                 vocab_size: int | None = None, faults=None, device: str = "cpu",
                 graph_tokens: int = 0):
        self.memory = memory if isinstance(memory, list) else [memory]
        self.compute = ComputeSide(split, len(self.memory), device=device,
                                   graph_tokens=graph_tokens)
        self.compute.vocab_size, self.compute.faults = vocab_size, faults
        # each memory worker's slot count (the engine's allocators take it)
        self.pool_slots = min(m.pool.config.num_slots for m in self.memory)
        self.compute.pool_slots = self.pool_slots
        for m in self.memory:
            m.faults = faults
        self.params = self.compute.params
        self.link = _LocalLink(self.memory, self.params)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.compute.run(plan, self.link)

    def start_trace(self) -> None:
        """Record every device's timeline from the next step on (`lamina.trace`): the
        compute side's lane and each memory side's (attention runs inside the compute
        side's submit here: the memory lanes nest in its submits)."""
        for tr in (self.compute.tracer, *self.link.tracers):
            tr.start()

    def stop_trace(self) -> list[Span]:
        """The spans since `start_trace`, every lane; tracing off."""
        return [s for tr in (self.compute.tracer, *self.link.tracers) for s in tr.stop()]

    def tier_bytes_per_token(self) -> int | None:
        """KV bytes a token takes in the tiers; None when the memory sides keep none."""
        if any(m.tiers is None for m in self.memory):
            return None
        return self.memory[0].pool.config.bytes_per_slot

    def tier_rotary(self) -> bool:
        """Whether the memory sides can move saved keys to new positions (rotary)."""
        return all(m.tiers is not None and m.tiers.inv_freq is not None for m in self.memory)

    def tier_traffic(self) -> dict:
        """The memory sides' tier traffic (bytes) and misses, summed."""
        return sum_stats(m.tiers.stats for m in self.memory if m.tiers is not None)

    def shutdown(self) -> None:
        for m in self.memory:
            if m.tiers is not None:
                m.tiers.close()


def apply_tiers(memory: list[MemorySide], orders) -> None:
    """Each worker's tier orders, every worker's before any raises: one `TierMiss`
    naming all the sequences whose loads missed."""
    missed: list[TierMiss] = []
    for w, mem in enumerate(memory):
        try:
            mem.apply_tiers([o for o in orders if o.worker == w])
        except TierMiss as e:
            missed.append(e)
    if missed:
        raise TierMiss([s for e in missed for s in e.seq_ids],
                       [x for e in missed for x in e.entries],
                       "; ".join(str(e) for e in missed))
