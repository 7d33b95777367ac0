"""How long a change of memory workers takes, and how long it holds the decoding requests.

    python benchmarks/scale_probe.py [--executor ray] [--batch 8] [--new 600]
                                     [--hit-new 200] [--repeat 3] [--out DIR]

SmolLM2 through `LLM` (--executor ray: a local Ray instance; or local), one memory worker
to start with, its engine run by an `EngineLoop` (a server's loop) while --batch greedy
requests of --new tokens decode. Every few seconds the pool grows to two memory workers
and shrinks back, --repeat times each way, the grow done two ways side by side:
"on the engine thread" (`LLMEngine.scale_memory_workers` starts the worker itself, as a
caller that hands no `StartedMemory` does) and "started beside" (the worker started on
this thread by `Executor.start_memory_workers` while the steps go on; only its wiring
runs between two steps: what `LLM.scale_memory_workers` and `lamina scale` do). Per
kind: the change's wall time and the longest time between two step ends while it ran
(what every streaming client waited), medians over the repeats, beside the median step
gap of the whole run. Then a shrink that hits running sequences: a second worker
added, --batch requests decoding on it (the most free: the first one's pool holds the
earlier requests' cached prefixes); after 3 s the pool shrinks to one, their KV "moved"
into the kept pool (`Executor.move_kv`), or, side by side, with the move made to fail:
"preempted" (what a shrink did before moves; their KV computed again). Nothing here is
a target. Writes scale_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name
from lamina.entrypoints.engine_loop import EngineLoop


def timed_steps(llm: LLM) -> list[float]:
    """The end time of each step the engine runs from now on."""
    ends: list[float] = []
    step = llm.engine.step

    def timed():
        out = step()
        ends.append(time.perf_counter())
        return out
    llm.engine.step = timed
    return ends


def change(llm: LLM, loop: EngineLoop, ends: list[float], n: int, beside: bool) -> dict:
    """Memory workers -> n; -> its wall time and the longest step gap while it ran."""
    t0 = time.perf_counter()
    have = len(llm.engine.allocs)
    started = (llm.executor.start_memory_workers(have, n - have) if beside and n > have
               else None)
    loop.call(lambda e: e.scale_memory_workers(n, started)).result(300)
    t1 = time.perf_counter()
    time.sleep(0.5)  # a step or two after it, so the gap it ends is seen
    return {"s": t1 - t0, "stall_s": longest_gap(ends, t0 - 1.0, t1 + 0.5)}


def longest_gap(ends: list[float], lo: float, hi: float = float("inf")) -> float:
    """The longest time between two step ends within [lo, hi]."""
    around = [t for t in ends if lo <= t <= hi]
    return max((b - a for a, b in zip(around, around[1:])), default=float("nan"))


def shrink_hit(llm: LLM, loop: EngineLoop, ends: list[float], batch: int, new: int,
               r: int, move: bool) -> dict:
    """Two workers, `batch` requests; after 3 s down to one, the sequences on the leaving
    worker moved or (not `move`) preempted -> wall s, longest step gap, and what the
    change did."""
    loop.call(lambda e: e.scale_memory_workers(2)).result(300)
    tok = llm.loaded.tokenizer
    futs = [loop.submit(tok(f"Tale {r}-{b}-{move}: long ago")["input_ids"],
                        SamplingParams(max_tokens=new, ignore_eos=True, temperature=0))
            for b in range(batch)]
    time.sleep(3.0)
    real = llm.executor.move_kv
    if not move:  # the engine falls back to preempting them (and logs the failure)
        def off(moves):
            raise RuntimeError("moves off for the baseline")
        llm.executor.move_kv = off
    t0 = time.perf_counter()
    try:
        done = loop.call(lambda e: e.scale_memory_workers(1)).result(300)
    finally:
        llm.executor.move_kv = real
    t1 = time.perf_counter()
    for f in futs:
        f.result(600)
    return {"s": t1 - t0, "stall_s": longest_gap(ends, t0 - 1.0), "relocated": done.relocated,
            "relocated_tokens": done.relocated_tokens, "preempted": done.preempted,
            "recompute_tokens": done.recompute_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--executor", default="ray", choices=["ray", "local"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=600)
    ap.add_argument("--hit-new", type=int, default=200,
                    help="tokens each request of the shrink-hit phase decodes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args()
    llm = LLM(executor=args.executor, num_memory_workers=1, num_kv_slots=8192)
    ends = timed_steps(llm)
    loop = EngineLoop(llm.engine)
    tok = llm.loaded.tokenizer
    runs: dict[str, list[dict]] = {"grow (on the engine thread)": [],
                                   "grow (started beside)": [], "shrink": []}
    try:
        for r in range(args.repeat):
            futs = [loop.submit(tok(f"Story {r}-{b}: once upon a time")["input_ids"],
                                SamplingParams(max_tokens=args.new, ignore_eos=True,
                                               temperature=0)) for b in range(args.batch)]
            time.sleep(2.0)
            for kind, beside in (("grow (on the engine thread)", False),
                                 ("grow (started beside)", True)):
                runs[kind].append(change(llm, loop, ends, 2, beside))
                time.sleep(1.0)
                runs["shrink"].append(change(llm, loop, ends, 1, False))
                time.sleep(1.0)
            for f in futs:
                f.result(600)
        for r in range(args.repeat):
            for kind, move in (("shrink hitting sequences (moved)", True),
                               ("shrink hitting sequences (preempted)", False)):
                runs.setdefault(kind, []).append(
                    shrink_hit(llm, loop, ends, args.batch, args.hit_new, r, move))
    finally:
        loop.shutdown()
        llm.shutdown()
    step = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    rows = {k: {"s": statistics.median(x["s"] for x in v),
                "stall_s": statistics.median(x["stall_s"] for x in v), "runs": v}
            for k, v in runs.items()}
    result = {"cpu": cpu_name(), "executor": args.executor, "batch": args.batch,
              "repeat": args.repeat, "median_step_s": step, "changes": rows}
    table = [["change", "wall s (median)", "longest step gap s (median)",
              "sequences moved / preempted, positions moved / computed again (last run)"]]
    table += [[k, f"{v['s']:.3f}", f"{v['stall_s']:.3f}", _did(v["runs"][-1])]
              for k, v in rows.items()]
    table.append(["(median step gap of the run)", "", f"{step:.3f}", ""])
    jp, mp = _write(args.out, "scale_probe", result, table)
    print(mp.read_text())
    print(f"CPU: {result['cpu']}; wrote {jp}")


def _did(run: dict) -> str:
    if "relocated" not in run:
        return ""
    return (f"{run['relocated']} / {run['preempted']}, {run['relocated_tokens']} / "
            f"{run['recompute_tokens']}")


if __name__ == "__main__":
    main()
