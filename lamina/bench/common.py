"""Benchmarks reachable as `lamina bench NAME` (scripts in benchmarks/ call these).

Each runs the baseline and ours in one process, repeats, reports medians and the
ratio, and writes JSON plus a Markdown table under the output folder.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch


def _write(out_dir: Path, name: str, result: dict, table: list[list[str]]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jp, mp = out_dir / f"{name}.json", out_dir / f"{name}.md"
    jp.write_text(json.dumps(result, indent=2))
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    mp.write_text(f"# {name}\n\n" + "\n".join(md) + "\n")
    return jp, mp


VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides CPU speed here


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU for every measurement's record: /proc/cpuinfo's model name, its family
    and model (a cloud VM's name can be just "AMD EPYC", the same for five generations)
    and its widest vector instructions, e.g. "AMD EPYC (family 26 model 2; avx2 avx512f
    avx512_bf16)". `cpuinfo`: that file's text (default: read it)."""
    try:
        info: dict[str, str] = {}
        text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block is enough
            info.setdefault(key.strip(), value.strip())
        flags = set(info.get("flags", "").split())
        return (f"{info['model name']} (family {info.get('cpu family', '?')} model "
                f"{info.get('model', '?')}; {' '.join(f for f in VECTOR_FLAGS if f in flags)})")
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def median_ms(fn, repeat: int) -> float:
    """fn's median wall time over `repeat` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def clocked(obj, method: str) -> list[float]:
    """Wrap `obj.method` so every call's seconds (raised or not) are appended to the list
    returned (a probe's view of one stage, e.g. an executor's `execute` or `recover`)."""
    took, inner = [], getattr(obj, method)

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            took.append(time.perf_counter() - t)

    setattr(obj, method, timed)
    return took


def pct(xs, q):
    """The q-quantile of xs (Nones dropped; nearest rank), or None when empty."""
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _split_from_store(model, repeat: int) -> list[float]:
    """Seconds of `split_model` taking its graph from the on-disk trace store, as a fresh
    process does (the in-process copies dropped first); [] when the store is off."""
    from lamina.splitter import split_model, trace_store
    from lamina.splitter.trace import forget_traces

    if trace_store.store_dir() is None:
        return []
    split_model(model)  # stored now, if it was not
    times = []
    for _ in range(repeat):
        forget_traces()
        t = time.perf_counter()
        split_model(model)
        times.append(time.perf_counter() - t)
    return times


def bench_split(model_path: str | None = None, repeat: int = 3,
                out_dir: str | Path = "benchmarks/results") -> dict:
    """Time splitting (trace + cuts + slices) against the bare torch.export trace."""
    from lamina.model.loader import load
    from lamina.splitter import split_model, trace

    t0 = time.perf_counter()
    lm = load(model_path, with_tokenizer=False)
    load_s = time.perf_counter() - t0
    trace_only, split_total, parts = [], [], []
    for _ in range(repeat):
        t = time.perf_counter()
        trace(lm.model, reuse=False)  # baseline: what any export-based splitter pays
        trace_only.append(time.perf_counter() - t)
        sm = split_model(lm.model, reuse=False)  # traced afresh too: a like-for-like time
        split_total.append(sm.timings["total_s"])
        parts.append(sm.timings)
    stored = _split_from_store(lm.model, repeat)
    med = statistics.median
    res = {
        "model": lm.source, "model_type": sm.model_name, "slices": sm.num_slices,
        "threads": torch.get_num_threads(), "repeat": repeat, "machine": platform.machine(),
        "load_s": load_s,
        "baseline_trace_s_median": med(trace_only),
        "split_total_s_median": med(split_total),
        "split_trace_s_median": med(p["trace_s"] for p in parts),
        "split_cut_s_median": med(p["cut_s"] for p in parts),
        "split_build_s_median": med(p["build_s"] for p in parts),
        "ratio_split_over_trace": med(split_total) / med(trace_only),
        "target_s": 10.0,
        "all_split_s": split_total, "all_trace_s": trace_only,
        "store_split_s_median": med(stored) if stored else None, "all_store_split_s": stored,
    }
    table = [["what", "median s", "all runs s"],
             ["baseline: torch.export trace only", f"{res['baseline_trace_s_median']:.2f}",
              ", ".join(f"{x:.2f}" for x in trace_only)],
             ["ours: split (trace + cuts + slices)", f"{res['split_total_s_median']:.2f}",
              ", ".join(f"{x:.2f}" for x in split_total)],
             ["ours: split, graph from the trace store (a process's first split)",
              f"{res['store_split_s_median']:.2f}" if stored else "store off",
              ", ".join(f"{x:.2f}" for x in stored)],
             ["  of which min cuts", f"{res['split_cut_s_median']:.3f}", ""],
             ["  of which slice building", f"{res['split_build_s_median']:.3f}", ""],
             ["ratio split / trace", f"{res['ratio_split_over_trace']:.3f}", ""],
             ["target (split)", "10.00", ""]]
    jp, mp = _write(Path(out_dir), "split", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"split {res['split_total_s_median']:.2f}s median of {repeat} "
          f"({'within' if res['split_total_s_median'] <= 10 else 'OVER'} the 10 s target); "
          f"ratio to bare trace {res['ratio_split_over_trace']:.3f}; wrote {jp} and {mp}")
    return res
