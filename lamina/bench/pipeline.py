"""Decode with and without staggered pipelining, read from a real trace: `lamina bench
pipeline`.

Data in: batch sizes, context lengths, pipeline modes, an executor (local, or Ray with
`executor="ray"`). Data out: per case, decode tokens/s and each device's busy fraction
from the trace of the timed steps (`lamina.trace`); with `predict`, the simulator's
decode tokens/s for the same case (`lamina.costmodel.simulator.step_time`, calibrated
on this machine by `lamina.bench.sim.measure_ops` through the same executor, per-op
costs at 1 thread: the Ray workers' setting; the local executor runs the bench's
threads); JSON and
Markdown; with `plot`, a Gantt chart (one row per compute replica and memory worker,
one bar per task) of one traced decode step of each mode, drawn from the recorded
spans, not from a model.

Per case: B prompts of `context` distinct random tokens are prefilled, a warm-up
decode step runs, then `steps` decode steps are timed with every lane tracing. Modes
(`MODES`): "none", "rotational" (n = 2 on one compute replica), "rotational3" (n = 3
over 2 replicas; on Ray, two compute worker processes in a ring) and "fixed" (2
replicas, each with half the batch; on Ray, two compute worker processes). "none" and
"rotational" switch on one engine between cases (the same workers, weights and pools);
each replica mode runs on an engine of its own, built after the one before is shut
down (one set of pools at a time).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from lamina.bench.common import _write, cpu_name
from lamina.trace import Span, busy_fractions, lane_order, lanes

COLORS = {"slice": "tab:blue", "migrate": "tab:red", "submit": "tab:orange", "wait": "0.85",
          "sample": "tab:purple", "attend": "tab:green", "send": "tab:olive"}
# bench mode -> (EngineConfig.pipeline, compute replicas)
MODES = {"none": ("none", 1), "rotational": ("rotational", 1),
         "rotational3": ("rotational", 2), "fixed": ("fixed", 2)}


def decode_case(llm, batch: int, context: int, mode: str, steps: int = 4,
                seed: int = 0) -> dict:
    """`batch` sequences of `context` prompt tokens decoding under pipeline `mode`:
    tokens/s over `steps` timed decode steps, busy fractions, and the spans. Every
    timed step decodes all `batch` sequences: the first prompts' sequences decode while
    the last are prefilled, so their token budget covers the whole prefill (a smaller
    one let them finish before the timed steps, which then ran short batches); a timed
    step with fewer is an error, not a number."""
    from lamina import SamplingParams

    eng = llm.engine
    pipeline, replicas = MODES[mode]
    if eng.config.pipeline != pipeline:  # one replica: the engine switches
        assert replicas == 1 == eng.config.num_compute_workers
        eng.config = replace(eng.config, pipeline=pipeline)
    rng = random.Random(seed)
    # prefill steps: at most one per prompt, or its token count over the step budget
    chunks = batch + -(-batch * context // eng.config.max_step_tokens)
    params = SamplingParams(max_tokens=chunks + steps + 8, temperature=0, ignore_eos=True)
    ids = [eng.add_request([rng.randrange(1000, 20000) for _ in range(context)], params)
           for _ in range(batch)]
    while any(not s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill (chunks of max_step_tokens)
    eng.step()  # one decode step before timing
    llm.executor.start_trace()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    seconds = time.perf_counter() - t0
    spans = llm.executor.stop_trace()
    short = [t["seqs"] for t in list(eng.step_timings)[-steps:] if t["seqs"] != batch]
    for rid in ids:
        eng.abort(rid)
    if short:
        raise RuntimeError(f"B={batch}, context {context}, {mode}: timed steps decoded "
                           f"{short} sequences, not {batch}")
    return {"batch": batch, "context": context, "mode": mode, "steps": steps,
            "tok_s": batch * steps / seconds, "busy": busy_fractions(spans),
            "spans": spans}


def _spare(batches, context: int, steps: int) -> int:
    """Slots a sequence needs past its prompt in `decode_case` (max_step_tokens 4096)."""
    return max(batches) + -(-max(batches) * context // 4096) + steps + 8


def predicted_tok_s(costs, batch: int, context: int, mode: str, workers: int) -> float:
    """The simulator's steady decode tokens/s: `batch` sequences of about `context`
    keys spread over `workers` memory workers, pipeline `mode` (`MODES`)."""
    from lamina.costmodel.simulator import decode_step_time

    pipeline, replicas = MODES[mode]
    n = replicas if pipeline == "fixed" else replicas + 1  # batches
    return batch / decode_step_time(costs, batch, context, workers, pipeline, n)


# The paper's Table 3 settings: model, A100s holding its weights (tensor parallel)
PAPER_SETTINGS = (("llama-13b", 1), ("llama-33b", 2), ("llama-65b", 4))


def paper_predictions(batches=(128, 256, 512, 1024), contexts=(1024, 4096),
                      device: str = "a100-80g",
                      out_dir: str | Path = "benchmarks/results") -> dict:
    """What the simulator predicts for the paper's hardware (no model runs): its Table
    3 settings, compute and memory devices both `device` (the paper emulates memory
    devices with A100s, 200 Gb/s NICs), per-op costs from the catalog
    (`AnalyticCosts`, default `Efficiency`: the MFU curve Table 3 implies). Per case the
    memory devices are the balance rule's for n = 2 (`balance_memory_devices`), at
    least as many as hold the KV; none and rotational n = 2 run on those same devices,
    rotational n = 3 adds a replica and takes its own balanced count."""
    from lamina.costmodel.analytic import Efficiency
    from lamina.costmodel.catalog import load_catalog, model_shape
    from lamina.costmodel.simulator import (
        AnalyticCosts,
        balance_memory_devices,
        decode_step_time,
    )

    dev, eff, rows = load_catalog()[device], Efficiency(), []
    for name, tp in PAPER_SETTINGS:
        shape = model_shape(name)
        costs = AnalyticCosts(shape, dev, tp, dev, eff)
        for ctx in contexts:
            need = shape.kv_bytes_per_token() * ctx / (dev.memory_gb * 1e9 * eff.mem_usable)
            for b in batches:
                fit = math.ceil(b * need)  # memory devices the batch's KV needs
                m2 = max(fit, balance_memory_devices(costs, b, ctx, 2))
                m3 = max(fit, balance_memory_devices(costs, b, ctx, 3))
                none = b / decode_step_time(costs, b, ctx, m2)
                rot2 = b / decode_step_time(costs, b, ctx, m2, "rotational", 2)
                rot3 = b / decode_step_time(costs, b, ctx, m3, "rotational", 3)
                rows.append({"model": name, "tp": tp, "context": ctx, "batch": b,
                             "memory_devices": m2, "memory_devices_n3": m3,
                             "none_tok_s": none, "rotational_tok_s": rot2,
                             "rotational3_tok_s": rot3, "gain": rot2 / none,
                             # n = 3 runs 2 replicas: its gain per compute device
                             "gain3_per_replica": rot3 / none / 2})
    table = [["model", "A100s", "context", "B", "memory devices", "none tok/s",
              "rotational n=2 tok/s", "x none", "n=3 (2 replicas) tok/s", "n=3 x none",
              "n=3 memory devices"]]
    for r in rows:
        table.append([r["model"], str(r["tp"]), str(r["context"]), str(r["batch"]),
                      str(r["memory_devices"]), f"{r['none_tok_s']:.0f}",
                      f"{r['rotational_tok_s']:.0f}", f"{r['gain']:.2f}",
                      f"{r['rotational3_tok_s']:.0f}",
                      f"{r['rotational3_tok_s'] / r['none_tok_s']:.2f}",
                      str(r["memory_devices_n3"])])
    res = {"device": device, "efficiency": eff.__dict__, "rows": rows}
    jp, mp = _write(Path(out_dir), "pipeline_paper", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res


def last_step(spans: list[Span]) -> list[Span]:
    """The spans of the last step traced (every lane's)."""
    last = max(s.step for s in spans)
    return [s for s in spans if s.step == last]


def plot_trace(groups: dict[str, list[Span]], path: str | Path) -> Path:
    """A Gantt chart per group (title -> spans), stacked: one row per lane, one bar per
    span, coloured by kind, milliseconds from the group's first span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 1.2 + 0.9 * max(
        len(lanes(s)) for s in groups.values()) * len(groups)), squeeze=False)
    for ax, (title, spans) in zip(axes[:, 0], groups.items()):
        names, t0 = lanes(spans), min(s.t0 for s in spans)
        for row, lane in enumerate(names):
            for kind in COLORS:
                bars = [((s.t0 - t0) * 1e3, s.seconds * 1e3) for s in spans
                        if s.lane == lane and s.kind == kind]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[kind])
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms")
    axes[0, 0].legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
                      loc="lower right", fontsize=7, ncol=5,
                      bbox_to_anchor=(1.0, 1.08), frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bench_pipeline(model: str | None = None, batches=(8, 32, 64), contexts=(512, 2048),
                   modes=tuple(MODES), executor: str = "local",
                   num_memory_workers: int = 1, steps: int = 4,
                   plot: str | Path | None = None, predict: bool = False,
                   out_dir: str | Path = "benchmarks/results") -> dict:
    """Each (context, batch, mode) case as `decode_case`, engine by engine (`MODES`:
    the one-replica modes share one; each replica mode has its own)."""
    from lamina import LLM

    slots = max(batches) * (max(contexts) + _spare(batches, max(contexts), steps))
    kw = dict(executor=executor, num_memory_workers=num_memory_workers,
              num_kv_slots=slots // num_memory_workers + 64, prefix_caching=False,
              max_batch=max(batches), max_step_tokens=4096)
    engines: dict[tuple, list[str]] = {}  # (pipeline, replicas) of the engine -> modes
    for m in modes:
        pipeline, replicas = MODES[m]
        engines.setdefault(("none", 1) if replicas == 1 else MODES[m], []).append(m)
    rows, shown, costs = [], {}, None
    for (pipeline, replicas), mine in engines.items():
        llm = LLM(model, **kw, **(dict(num_compute_workers=replicas, pipeline=pipeline)
                                  if replicas > 1 else {}))
        try:
            if predict and costs is None and replicas == 1:
                costs = _costs(llm, model, executor)
            _cases(llm, batches, contexts, mine, steps, costs, num_memory_workers, executor,
                   rows, shown)
        finally:
            llm.shutdown()
    rows.sort(key=lambda r: (r["context"], r["batch"], modes.index(r["mode"])))
    return _report(rows, shown, costs, modes, model, executor, num_memory_workers, plot,
                   out_dir)


def _costs(llm, model, executor):
    """Per-op costs at 1 thread, as each Ray worker runs (`measure_ops`); the probe
    writes into the pools' first slots, so it runs before any case."""
    from lamina.bench.sim import measure_ops
    from lamina.costmodel.simulator import MeasuredCosts

    threads = torch.get_num_threads()
    costs = MeasuredCosts(measure_ops(model, executor=llm.executor))
    torch.set_num_threads(threads)
    return costs


def _cases(llm, batches, contexts, modes, steps, costs, workers, executor, rows, shown):
    """Every (context, batch) case of `modes` on one engine, into `rows` (and the
    largest case's last step into `shown`)."""
    for ctx in contexts:
        for b in batches:
            for mode in modes:
                r = decode_case(llm, b, ctx, mode, steps)
                spans = r.pop("spans")
                if costs is not None:
                    r["predicted_tok_s"] = predicted_tok_s(costs, b, ctx, mode, workers)
                if b == max(batches) and ctx == max(contexts):
                    shown[f"{mode}: B={b}, context {ctx}, one decode step "
                          f"({executor} executor)"] = last_step(spans)
                rows.append(r)
                print(f"B={b} ctx={ctx} {mode}: {r['tok_s']:.1f} tok/s, busy "
                      + ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items()), flush=True)


def _report(rows, shown, costs, modes, model, executor, workers, plot, out_dir) -> dict:
    names = sorted({k for r in rows for k in r["busy"]}, key=lane_order)
    pred = ["simulator tok/s"] if costs is not None else []
    table = [["B", "context", "pipeline", "tok/s", "x none", *pred,
              *[f"busy {n}" for n in names]]]
    base = {(r["batch"], r["context"]): r["tok_s"] for r in rows if r["mode"] == modes[0]}
    for r in rows:
        p = r.get("predicted_tok_s")
        table.append([str(r["batch"]), str(r["context"]), r["mode"], f"{r['tok_s']:.1f}",
                      f"{r['tok_s'] / base[r['batch'], r['context']]:.2f}",
                      *([f"{p:.1f}" if p else "-"] if pred else []),
                      *[f"{r['busy'][n]:.0%}" if n in r["busy"] else "-" for n in names]])
    res = {"model": model or "SmolLM2-135M-Instruct", "cpu": cpu_name(),
           "executor": executor, "num_memory_workers": workers, "rows": rows}
    if plot:
        res["plot"] = str(plot_trace(shown, plot))
    jp, mp = _write(Path(out_dir), "pipeline", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}" + (f" and {res['plot']}" if plot else ""))
    return res


def bench_overlap(model: str | None = None, batches=(8, 32, 128), context: int = 512,
                  groups=(1, 4), num_memory_workers: int = 1, steps: int = 4,
                  out_dir: str | Path = "benchmarks/results") -> dict:
    """Communication-attention overlap (paper 5.2, Fig. 16) on the Ray executor: decode
    at each batch with each worker's q/k/v of a layer in `groups` groups (1: one frame;
    > 1: streamed, `EngineConfig.stream_groups`; both through the C++ ends), traced: tok/s,
    the data-plane time per step (the union of q/k/v and output sends) and the share
    of it hidden behind attention (`lamina.trace.hidden_fraction`)."""
    from lamina import LLM

    slots = max(batches) * (context + _spare(batches, context, steps))
    rows = []
    for g in groups:
        llm = LLM(model, executor="ray", num_memory_workers=num_memory_workers,
                  num_kv_slots=slots // num_memory_workers + 64, prefix_caching=False,
                  max_batch=max(batches), max_step_tokens=4096, stream_groups=g)
        try:
            rows += [overlap_case(llm, b, context, g, steps) for b in batches]
        finally:
            llm.shutdown()
    res = {"model": model or "SmolLM2-135M-Instruct", "cpu": cpu_name(), "executor": "ray",
           "num_memory_workers": num_memory_workers, "rows": rows}
    return overlap_report(res, groups, context, "overlap", out_dir)


def overlap_case(llm, batch: int, context: int, groups: int, steps: int) -> dict:
    """One `bench_overlap` row: `decode_case` with the data-plane time a step and the
    share of it hidden behind attention, from its trace."""
    from lamina.trace import hidden_fraction, transfer_seconds

    r = decode_case(llm, batch, context, "none", steps)
    spans = r.pop("spans")
    r.update(groups=groups, hidden=hidden_fraction(spans),
             data_plane_ms=1e3 * transfer_seconds(spans) / steps)
    print(f"B={batch} groups={groups}: {r['tok_s']:.1f} tok/s, data plane "
          f"{r['data_plane_ms']:.1f} ms/step, hidden {r['hidden'] or 0:.0%}", flush=True)
    return r


def overlap_report(res: dict, groups, context: int, name: str,
                   out_dir: str | Path) -> dict:
    """`res["rows"]` (`overlap_case`s) as a table against the first stream width,
    written as JSON + Markdown under `name` and printed."""
    rows = sorted(res["rows"], key=lambda r: (r["batch"], r["groups"]))
    base = {r["batch"]: r["tok_s"] for r in rows if r["groups"] == groups[0]}
    table = [["B", "context", "groups", "tok/s", f"x groups {groups[0]}",
              "data plane ms/step", "hidden behind attention"]]
    for r in rows:
        table.append([str(r["batch"]), str(context), str(r["groups"]), f"{r['tok_s']:.1f}",
                      f"{r['tok_s'] / base[r['batch']]:.2f}", f"{r['data_plane_ms']:.1f}",
                      f"{(r['hidden'] or 0):.0%}"])
    jp, mp = _write(Path(out_dir), name, {**res, "rows": rows}, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res
