"""Step-plan size and cost: `lamina bench plan`.

Data in: B sequences of context L (prompts of L tokens, decoding). Data out: per L, a
decode step's plan bytes (msgpack, as the control channel sends it), the scheduler's
time to make it and the compute side's time to rebuild the whole slot tables from it
(`SlotTables.apply`), with plans as diffs (what runs) and with whole tables every step
(what ran before: every position's slot of every sequence); JSON and Markdown.
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import msgspec

from lamina.bench.common import _write
from lamina.compute.compute_side import SlotTables
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.sampling.params import SamplingParams


def _case(B: int, L: int, steps: int, whole: bool) -> dict:
    s = Scheduler(SchedulerConfig(B, B * L, True),
                  KVAllocator(KVAllocatorConfig(B * (L + steps + 2))))
    for i in range(B):
        s.add(Sequence(i, [7] * L, SamplingParams(max_tokens=steps + 2)))
    tables, enc = SlotTables(), msgspec.msgpack.Encoder()
    tables.apply(s.schedule())  # the prefill: whole tables either way
    sizes, t_plan, t_apply = [], [], []
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
        sizes.append(len(enc.encode(plan)))
        t_plan.append(t1 - t0)
        t_apply.append(t2 - t1)
    return {"plan_bytes": statistics.median(sizes),
            "schedule_ms": 1e3 * statistics.median(t_plan),
            "apply_ms": 1e3 * statistics.median(t_apply)}


def bench_plan(batch: int = 32, lengths=(128, 8192), steps: int = 20,
               out_dir: str | Path = "benchmarks/results") -> dict:
    rows = []
    for L in lengths:
        for mode in ("diffs", "whole tables"):
            r = {"B": batch, "L": L, "plans": mode, **_case(batch, L, steps, mode != "diffs")}
            rows.append(r)
            print(r, flush=True)
    res = {"cpu": platform.processor() or platform.machine(), "steps": steps, "rows": rows}
    table = [["B", "L", "plans", "plan bytes", "schedule ms", "apply ms"]]
    table += [[str(r["B"]), str(r["L"]), r["plans"], f"{r['plan_bytes']:.0f}",
               f"{r['schedule_ms']:.3f}", f"{r['apply_ms']:.3f}"] for r in rows]
    jp, mp = _write(Path(out_dir), "plan", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res
