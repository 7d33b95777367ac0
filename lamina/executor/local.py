"""`LocalExecutor`: the compute side(s) and the memory sides in this one process.

Data in: `StepPlan`. Data out: `StepResult`. Attention runs inside `submit` (no
overlap), except under rotational pipelining over several replicas, where each memory
side is a thread of its own (a device doing one attention at a time, in the order
submitted) so replicas go on while it attends. The same `ComputeSide` runs in
`lamina.cluster`'s Ray compute worker, where the memory link is the data plane instead.

Compute replicas (`num_compute_workers` > 1, pipeline "fixed", paper 5.1): one
`ComputeSide` per replica, each run on a thread of its own over the shared slices
(weights are read-only), each with its own batch (`lamina.executor.replicas`: a
sequence is placed on the replica with the fewest sequences when first seen and stays
there, where its slot table lives). A memory side serves one replica at a time (a lock
per memory side: one device does one attention at a time), so a replica whose
attention is queued waits, the fixed schedule's bubbles. torch ops release the GIL,
so the replicas' slices do run at once.

Rotational (pipeline "rotational", n batches over R = n - 1 replicas, paper 5.1): one
`ComputeSide` packs the step into n micro-batches and runs slice k of micro-batch j on
replica (j + k) mod R, each replica a thread with its own lane (`ComputeSide.use_replicas`);
the context moves between replicas by reference (one process, one device).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from lamina.compute.compute_side import ComputeSide
from lamina.compute.memory_link import MemoryLink, combine
from lamina.compute.packing import WorkerPart
from lamina.engine.messages import DroppedKeys, StartedMemory, StepPlan, StepResult
from lamina.executor.base import Executor
from lamina.executor.replicas import ReplicaSplit
from lamina.memory.memory_side import MemorySide
from lamina.memory.tier_orders import SlotMove, TierMiss, TierMove, sum_stats
from lamina.splitter.split import SplitModel
from lamina.trace import Span, Tracer


@dataclass(frozen=True)
class _Shared:
    """What the replicas' links share: per memory side, its lock and its lane."""

    locks: list[threading.Lock]
    tracers: list[Tracer]
    # per memory side, its thread (asynchronous memory sides: rotational replicas); None
    threads: list[ThreadPoolExecutor] | None = None


class _LocalLink(MemoryLink):
    """Memory sides in this process: attention runs inside `submit` (no overlap). One
    link per compute replica; a memory side serves one at a time (`shared.locks`)."""

    def __init__(self, memory: list[MemorySide], params, shared: _Shared):
        self.memory, self.params, self.shared = memory, params, shared
        devices = {m.device for m in memory}
        # memory sides on one GPU take a GPU compute side's q/k/v as they are
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self.ready: dict[tuple[int, int], list] = {}
        self.report = False  # this step's `report_dropped`

    def begin(self, step, parts, released=(), tier_orders=(), overrides=None,
              report_dropped=False):
        # in-process: whole SlotBatches
        self.settle()
        self.report, self.step = report_dropped, step
        if tier_orders:
            apply_tiers(self.memory, tier_orders)
        for w, mem in enumerate(self.memory):
            with self.shared.locks[w]:
                if released:
                    mem.release(released)
                if overrides:
                    mem.override(overrides)
                for mb in parts:
                    if mb[w].active:
                        mem.check(mb[w].new_slots, mb[w].batch, mb[w].seq_ids)

    def submit(self, layer, mb, q, k, v, parts):
        th = self.shared.threads
        if th is None:
            self.ready[layer, mb] = [self._attend(w, layer, mb, q, k, v, p) if p.active
                                     else None for w, p in enumerate(parts)]
        else:  # each memory side's thread attends; `collect` waits
            self.ready[layer, mb] = [th[w].submit(self._attend, w, layer, mb, q, k, v, p)
                                     if p.active else None for w, p in enumerate(parts)]

    @torch.no_grad()  # on a memory side's thread (grad mode is per thread)
    def _attend(self, w: int, layer: int, mb: int, q, k, v, p: WorkerPart):
        wq, wk, wv = p.take(q, k, v)
        with self.shared.locks[w]:
            t = time.perf_counter()
            out = self.memory[w].attend(layer, self.params[layer], wq, wk, wv, p.new_slots,
                                        p.batch, checked=True, seq_ids=p.seq_ids)
            self.shared.tracers[w].record("attend", layer, t, step=self.step, mb=mb)
        return out

    def collect(self, layer, mb, parts, out_shape, dtype, merge=False):
        outs = self.ready.pop((layer, mb))
        if self.shared.threads is not None:
            outs = [None if f is None else f.result() for f in outs]
        return combine(parts, outs, out_shape, dtype, merge)

    def settle(self) -> None:
        """Wait out attention still in flight (a step that failed part-way), so the
        next step starts on memory sides at rest; drop its outputs."""
        for outs in self.ready.values():
            for f in outs:
                if isinstance(f, Future):
                    f.exception()  # waits; the step already failed with its own error
        self.ready.clear()

    def dropped(self) -> tuple[DroppedKeys, ...]:
        if not self.report:
            return ()
        out = []
        for w, mem in enumerate(self.memory):
            with self.shared.locks[w]:
                got = mem.take_dropped()
            out += [DroppedKeys(sid, w, tuple(slots.tolist())) for sid, slots in sorted(
                got.items())]
        return tuple(out)


class LocalExecutor(Executor):
    def __init__(self, split: SplitModel, memory: MemorySide | list[MemorySide],
                 vocab_size: int | None = None, faults=None, device: str = "cpu",
                 graph_tokens: int = 0, num_compute_workers: int = 1,
                 pipeline: str = "fixed"):
        """`pipeline` says how `num_compute_workers` > 1 replicas share a step: "fixed"
        (each its own sequences) or "rotational" (each micro-batch's slices rotate)."""
        self.memory = memory if isinstance(memory, list) else [memory]
        # each memory worker's slot count (the engine's allocators take it)
        self.pool_slots = min(m.pool.config.num_slots for m in self.memory)
        rotating = pipeline == "rotational" and num_compute_workers > 1
        self.replicas = [ComputeSide(split, len(self.memory), device=device,
                                     graph_tokens=graph_tokens)
                         for _ in range(1 if rotating else num_compute_workers)]
        for r, c in enumerate(self.replicas):
            c.vocab_size, c.faults, c.pool_slots = vocab_size, faults, self.pool_slots
            c.tracer.lane = f"compute{r}"
        self.compute = self.replicas[0]
        for m in self.memory:
            m.faults = faults
        self.params = self.compute.params
        if rotating:
            self.compute.use_replicas([Tracer(f"compute{r}")
                                       for r in range(num_compute_workers)])
        threads = ([ThreadPoolExecutor(1, f"lamina-memory{w}") for w in range(len(self.memory))]
                   if rotating else None)
        shared = _Shared([threading.Lock() for _ in self.memory],
                         [Tracer(f"memory{w}") for w in range(len(self.memory))], threads)
        self.links = [_LocalLink(self.memory, self.params, shared) for _ in self.replicas]
        self.link = self.links[0]
        # the fixed schedule's sequences by replica (rotational: one ComputeSide)
        self.replica_split = (ReplicaSplit(len(self.replicas)) if len(self.replicas) > 1
                              else None)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.replica_split is None:
            return self.compute.run(plan, self.link)
        if plan.tier_orders:  # once, before the split (each replica's step would apply them)
            apply_tiers(self.memory, plan.tier_orders)
            plan = replace(plan, tier_orders=())
        return self.replica_split.run(plan,
                                      lambda r, p: self.replicas[r].run(p, self.links[r]))

    def recover(self, error: BaseException) -> bool:
        """A step failed part-way in this process (an error no check caught: a bug, data
        a kernel refuses). Nothing died, but what the step half did and what is kept per
        sequence cannot be trusted: attention in flight is waited out, and every
        replica's slot tables and every memory side's per-sequence state (selections,
        tiers) are dropped. The pools' bytes stay (`kv_kept`): the engine keeps the KV of
        the positions computed before the failed step."""
        for link in self.links:
            link.settle()
        for c in self.replicas:
            c.reset()
        for m in self.memory:
            m.reset()
        if self.replica_split is not None:
            self.replica_split.reset()
        return True

    def kv_kept(self) -> frozenset[int]:
        return frozenset(range(len(self.memory)))

    def start_memory_workers(self, first: int, k: int) -> StartedMemory:
        """Memory sides like the first (`MemorySide.sibling`: their pools allocated)."""
        return StartedMemory(first, k, [self.memory[0].sibling(w)
                                        for w in range(first, first + k)])

    def add_memory_workers(self, started: StartedMemory) -> None:
        """The started memory sides, each with its lock, lane and (rotational) thread;
        every replica's packing counts them."""
        if started.first != len(self.memory):
            self.discard_memory_workers(started)
            raise ValueError(f"memory sides started as {started.first}.., but there are "
                             f"{len(self.memory)}")
        shared = self.link.shared
        for mem in started.workers:
            w = len(self.memory)
            self.memory.append(mem)  # the links' list too
            shared.locks.append(threading.Lock())
            shared.tracers.append(Tracer(f"memory{w}"))
            if shared.threads is not None:
                shared.threads.append(ThreadPoolExecutor(1, f"lamina-memory{w}"))
        for c in self.replicas:
            c.num_workers = len(self.memory)

    def discard_memory_workers(self, started: StartedMemory) -> None:
        _close_tiers(started.workers)

    def move_tiers(self, moves: tuple[TierMove, ...]) -> frozenset[int]:
        moved: set[int] = set()
        for m in moves:
            src, dest = self.memory[m.source].tiers, self.memory[m.dest].tiers
            if src is not None and dest is not None:
                moved.update(dest.adopt(src.export([m.entry])))
        return frozenset(moved)

    def move_kv(self, moves: tuple[SlotMove, ...]) -> None:
        for m in moves:
            self.memory[m.dest].pool.put(m.dst_slots, *self.memory[m.source].pool.read(
                m.src_slots))

    def remove_memory_workers(self, n: int) -> None:
        """Memory sides n.. go (their tier files with them)."""
        shared = self.link.shared
        _close_tiers(self.memory[n:])
        for th in (shared.threads or [])[n:]:
            th.shutdown()
        for lst in (self.memory, shared.locks, shared.tracers, shared.threads or []):
            del lst[n:]
        for c in self.replicas:
            c.num_workers = n

    def _tracers(self) -> list[Tracer]:
        return [*(lane for c in self.replicas for lane in c.lanes),
                *self.link.shared.tracers]

    def start_trace(self) -> None:
        """Record every device's timeline from the next step on (`lamina.trace`): each
        compute replica's lane and each memory side's (attention runs inside the compute
        side's submit here: the memory lanes nest in its submits)."""
        for tr in self._tracers():
            tr.start()

    def stop_trace(self) -> list[Span]:
        """The spans since `start_trace`, every lane; tracing off."""
        return [s for tr in self._tracers() for s in tr.stop()]

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
        for th in self.link.shared.threads or ():
            th.shutdown()
        if self.replica_split is not None:
            self.replica_split.shutdown()
        _close_tiers(self.memory)


def _close_tiers(memory: list[MemorySide]) -> None:
    """The memory sides' tier stores closed (their files deleted)."""
    for m in memory:
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

