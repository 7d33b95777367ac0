"""Step-plan size and cost: `lamina bench plan`.

Data in: B sequences of context L (prompts of L tokens, decoding). Data out: per L, a
decode step's plan bytes (msgpack, as the control channel sends it), the scheduler's
time to make it, the compute side's time to rebuild the whole slot tables from it
(`SlotTables.apply`) and to pack it, and the bytes of the memory worker's step metadata
on the data plane (its META frames, `lamina.dataplane.protocol.step_meta`), with plans
and metadata as diffs (what runs: the memory worker holds each table) and with whole
tables every step (what ran before: every position's slot of every sequence, in the
plan and again to the memory worker); JSON and Markdown.
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import msgspec

from lamina.bench.common import _write
from lamina.compute.compute_side import SlotTables
from lamina.compute.packing import pack
from lamina.dataplane.protocol import step_meta
from lamina.dataplane.tables import SentTables
from lamina.dataplane.transport import HEADER
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.sampling.params import SamplingParams


def _case(B: int, L: int, steps: int, whole: bool) -> dict:
    s = Scheduler(SchedulerConfig(B, B * L, True),
                  KVAllocator(KVAllocatorConfig(B * (L + steps + 2))))
    for i in range(B):
        s.add(Sequence(i, [7] * L, SamplingParams(max_tokens=steps + 2)))
    tables, enc, held = SlotTables(), msgspec.msgpack.Encoder(), SentTables()
    first = s.schedule()  # the prefill: whole tables either way
    tables.apply(first)
    step_meta(list(pack(first, 1, tables=tables).parts), held)
    sizes, t_plan, t_apply, t_pack, meta = [], [], [], [], []
    for _ in range(steps):
        for q in s.running:
            q.output.append(3)
            if whole:
                q.sent = 0  # as before diffs: the whole table every step
        t0 = time.perf_counter()
        plan = s.schedule()
        t1 = time.perf_counter()
        tables.apply(plan)
        t2 = time.perf_counter()
        parts = pack(plan, 1, tables=tables).parts
        t3 = time.perf_counter()
        frames = step_meta(list(parts), SentTables() if whole else held)
        meta.append(sum(HEADER.size + 8 * f.dim() + f.numel() * f.element_size()
                        for f in frames))  # as framed on the wire
        sizes.append(len(enc.encode(plan)))
        t_plan.append(t1 - t0)
        t_apply.append(t2 - t1)
        t_pack.append(t3 - t2)
    return {"plan_bytes": statistics.median(sizes),
            "schedule_ms": 1e3 * statistics.median(t_plan),
            "apply_ms": 1e3 * statistics.median(t_apply),
            "pack_ms": 1e3 * statistics.median(t_pack),
            "meta_bytes": statistics.median(meta)}


def bench_plan(batch: int = 32, lengths=(128, 8192), steps: int = 20,
               out_dir: str | Path = "benchmarks/results") -> dict:
    rows = []
    for L in lengths:
        for mode in ("diffs", "whole tables"):
            r = {"B": batch, "L": L, "plans": mode, **_case(batch, L, steps, mode != "diffs")}
            rows.append(r)
            print(r, flush=True)
    res = {"cpu": platform.processor() or platform.machine(), "steps": steps, "rows": rows}
    table = [["B", "L", "plans", "plan bytes", "schedule ms", "apply ms", "pack ms",
              "memory-worker metadata bytes"]]
    table += [[str(r["B"]), str(r["L"]), r["plans"], f"{r['plan_bytes']:.0f}",
               f"{r['schedule_ms']:.3f}", f"{r['apply_ms']:.3f}", f"{r['pack_ms']:.3f}",
               f"{r['meta_bytes']:.0f}"] for r in rows]
    jp, mp = _write(Path(out_dir), "plan", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res
