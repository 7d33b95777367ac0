"""A run's per-device timeline (`Tracer`, `Span`): what each compute replica and each
memory worker did, and when.

Data in: spans recorded where the work runs. The compute side (`ComputeSide.run`)
records, per step, layer and micro-batch, its slices (`slice`), a micro-batch's context
arriving from the replica that ran its previous slice (`migrate`, rotational
pipelining; `peer` names that replica, `nbytes` what moved), its q/k/v handed to the
memory workers (`submit`), its waits for their outputs (`wait`; where one C++ call does
both, its sending and its waiting as the two) and sampling (`sample`), and the
attention of prompts it attends itself (`attend`); whoever runs a memory worker's
attention (the
local executor's link, a Ray memory worker's `MemoryServer`) records `attend` per layer
and micro-batch on that worker's lane; a `MemoryServer`'s output sender records `send`
on its own lane ("send0" for "memory0": it runs while the worker attends).
Data out: `Span`s. Times are `time.perf_counter()` seconds, which on Linux is
CLOCK_MONOTONIC: one clock for every process on a host, so lanes recorded in different
processes (Ray workers) line up without any offset. `lamina.bench.pipeline` draws them
as a Gantt chart and reads busy fractions and overlap from them.

A tracer is off until `start`; off, `record` returns at once (the step path calls it
unconditionally). `limit` bounds what one trace keeps: a run left tracing cannot grow
without end (the spans past it are counted, not kept).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

KINDS = ("slice", "migrate", "submit", "wait", "sample", "attend", "send")


@dataclass(frozen=True)
class Span:
    lane: str  # "compute0", "memory1", ...
    kind: str  # one of KINDS
    step: int
    layer: int  # -1: not one layer's (sampling)
    mb: int  # micro-batch
    t0: float  # perf_counter seconds (CLOCK_MONOTONIC)
    t1: float
    peer: str = ""  # a transfer's other end (`migrate`: the lane it came from)
    nbytes: int = 0  # a transfer's bytes

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class Tracer:
    """One lane's spans. `step` / `mb` are the step and micro-batch the caller is in,
    for recorders that do not know them (set by whoever does)."""

    def __init__(self, lane: str, limit: int = 1_000_000):
        self.lane, self.limit = lane, limit
        self.enabled = False
        self.spans: list[Span] = []
        self.dropped = 0  # spans past `limit`
        self.step, self.mb = -1, 0

    def start(self) -> None:
        self.enabled, self.spans, self.dropped = True, [], 0

    def stop(self) -> list[Span]:
        """The spans since `start`; tracing off."""
        spans, self.spans, self.enabled = self.spans, [], False
        return spans

    def record(self, kind: str, layer: int, t0: float, t1: float | None = None,
               step: int | None = None, mb: int | None = None, peer: str = "",
               nbytes: int = 0) -> None:
        if not self.enabled:
            return
        if len(self.spans) >= self.limit:
            self.dropped += 1
            return
        self.spans.append(Span(self.lane, kind, self.step if step is None else step, layer,
                               self.mb if mb is None else mb, t0,
                               time.perf_counter() if t1 is None else t1, peer, nbytes))


def lane_order(lane: str) -> tuple:
    """A lane's place in drawing order: compute replicas, then memory workers, by index."""
    name = lane.rstrip("0123456789")
    return (name != "compute", name, int(lane[len(name):] or 0))


def lanes(spans: list[Span]) -> list[str]:
    """The lanes of `spans` in drawing order (`lane_order`)."""
    return sorted({s.lane for s in spans}, key=lane_order)


def busy_fractions(spans: list[Span]) -> dict[str, float]:
    """Per lane: the fraction of the traced wall time (first start to last end over all
    lanes) it spent in spans; waits (`wait`) are not busy."""
    work = [s for s in spans if s.kind != "wait"]
    if not work:
        return {}
    t0, t1 = min(s.t0 for s in spans), max(s.t1 for s in spans)
    out = {}
    for lane in lanes(spans):
        mine = sorted((s.t0, s.t1) for s in work if s.lane == lane)
        out[lane] = _union(mine) / (t1 - t0) if t1 > t0 else 0.0
    return out


def _union(iv: list[tuple[float, float]]) -> float:
    """Total length of intervals' union."""
    return sum(b - a for a, b in _merged(iv))


def overlapping(spans: list[Span], slack: float = 0.0) -> list[tuple[Span, Span]]:
    """Pairs of spans on one lane that overlap by more than `slack` seconds (a device
    running two tasks at once). A lane's spans nest nowhere: each kind is one task."""
    out = []
    for lane in lanes(spans):
        mine = sorted((s for s in spans if s.lane == lane), key=lambda s: s.t0)
        for a, b in zip(mine, mine[1:]):
            if b.t0 < a.t1 - slack:
                out.append((a, b))
    return out


def hidden_fraction(spans: list[Span]) -> float | None:
    """The share of data-plane time spent while a memory worker attends (paper 5.2's
    communication-attention overlap): the compute side's q/k/v sends (`submit`) and the
    memory workers' output sends (`send`), measured against the union of `attend`
    spans on memory lanes. None when the spans hold no transfer."""
    moves = _transfers(spans)
    work = _merged([(s.t0, s.t1) for s in spans
                    if s.kind == "attend" and s.lane.startswith("memory")])
    total = sum(b - a for a, b in moves)
    if total <= 0:
        return None
    hidden, j = 0.0, 0
    for a, b in moves:  # both lists sorted and disjoint: one sweep
        while j < len(work) and work[j][1] <= a:
            j += 1
        k = j
        while k < len(work) and work[k][0] < b:
            hidden += min(b, work[k][1]) - max(a, work[k][0])
            k += 1
    return hidden / total


def transfer_seconds(spans: list[Span]) -> float:
    """Data-plane time: the union of q/k/v sends (`submit`) and output sends (`send`)."""
    return sum(b - a for a, b in _transfers(spans))


def _transfers(spans: list[Span]) -> list[tuple[float, float]]:
    return _merged([(s.t0, s.t1) for s in spans if s.kind in ("submit", "send")])


def _merged(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals as their sorted, disjoint union."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
