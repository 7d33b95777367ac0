"""`lamina cost-report`: best homogeneous vs offloaded configurations, as HTML or Markdown
plus JSON and PNG plots.

Data in: a model (built-in name or HF folder), compute and memory device names from the
hardware catalog, context lengths, a TPOT bound. Data out: `report.json` (checked
against `REPORT_SCHEMA`), `report.html` or `report.md`, and PNGs, in the output folder.
The numbers come from `lamina.costmodel.analytic` (analytic optimizer) and
`lamina.costmodel.simulator` (the recommended configuration under Poisson load).
"""
from __future__ import annotations

import html
import json
from dataclasses import replace
from pathlib import Path

from lamina.costmodel.analytic import Efficiency, best, min_interconnect_curve, min_tp
from lamina.costmodel.catalog import device as get_device
from lamina.costmodel.catalog import load_catalog, model_shape

_EST = {"type": "object", "required": ["compute", "tp", "memory", "memory_devices", "pipeline",
                                       "batch", "tpot_ms", "tokens_per_s", "price_usd",
                                       "tokens_per_s_per_kusd"]}
REPORT_SCHEMA = {
    "type": "object",
    "required": ["model", "compute", "memory", "tpot_slo_ms", "contexts", "plots"],
    "properties": {
        "model": {"type": "object", "required": ["name", "params", "layers", "d_model"]},
        "compute": {"type": "object", "required": ["name", "price_usd"]},
        "memory": {"type": "object", "required": ["name", "price_usd"]},
        "tpot_slo_ms": {"type": ["number", "null"]},
        "contexts": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["context", "homogeneous", "offloaded", "gain", "sweep",
                         "min_bandwidth", "simulation"],
            "properties": {
                "context": {"type": "integer", "minimum": 1},
                "homogeneous": {"anyOf": [_EST, {"type": "null"}]},
                "offloaded": {"anyOf": [_EST, {"type": "null"}]},
                "gain": {"type": ["number", "null"]},
                "sweep": {"type": "array", "items": {
                    "type": "object", "required": ["memory_per_compute", "tokens_per_s_per_kusd"]}},
                "min_bandwidth": {"type": "array", "items": {
                    "type": "object", "required": ["batch", "gbps"]}},
                "simulation": {"type": ["object", "null"]},
            }}},
        "plots": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def build_report(model: str, compute: str, memory: str, contexts=(512, 4096),
                 catalog: str | None = None, tpot_slo_ms: float | None = 250.0,
                 max_memory_per_compute: int = 32, simulate_requests: int = 300,
                 eff: Efficiency = Efficiency(), kv_dtype: str | None = None) -> dict:
    """`kv_dtype`: the KV as the memory devices store it (None: the weights' dtype);
    "int8" holds ~1.9x bf16's tokens a device."""
    cat = load_catalog(catalog)
    c_dev, m_dev = get_device(cat, compute), get_device(cat, memory)
    shape = model_shape(model)
    if kv_dtype:
        shape = replace(shape, kv_dtype=kv_dtype)
    if not contexts or any(not isinstance(c, int) or c < 1 for c in contexts):
        raise ValueError(f"contexts must be positive ints, got {contexts!r}")
    slo = tpot_slo_ms / 1e3 if tpot_slo_ms else None
    out = {"model": {"name": shape.name, "params": shape.params, "layers": shape.layers,
                     "d_model": shape.d_model, "kv_heads": shape.kv_heads,
                     "kv_bytes_per_token": shape.kv_bytes_per_token(),
                     "kv_dtype": shape.kv_dtype or "as the weights"},
           "compute": c_dev.__dict__, "memory": m_dev.__dict__, "tpot_slo_ms": tpot_slo_ms,
           "efficiency": eff.__dict__, "contexts": [], "plots": {}}
    ms = range(1, max_memory_per_compute * 8 + 1)
    for ctx in contexts:
        homo = best(shape, c_dev, ctx, tpot_slo_s=slo, eff=eff)
        off = best(shape, c_dev, ctx, m_dev, ms, tpot_slo_s=slo, eff=eff)
        sweep = []
        for ratio in range(1, max_memory_per_compute + 1):  # memory devices per compute one
            e = None
            for tp in (1, 2, 4, 8):
                if tp < min_tp(shape, c_dev, eff):
                    continue
                cand = best(shape, c_dev, ctx, m_dev, (ratio * tp,), tps=(tp,), tpot_slo_s=slo,
                            eff=eff)
                if cand and (e is None or cand.tokens_per_s_per_kusd > e.tokens_per_s_per_kusd):
                    e = cand
            sweep.append({"memory_per_compute": ratio,
                          "tokens_per_s_per_kusd": e.tokens_per_s_per_kusd if e else None,
                          "batch": e.batch if e else None})
        tp = off.cell.tp if off else min_tp(shape, c_dev, eff)
        bw = [{"batch": b, "gbps": g} for b, g in
              min_interconnect_curve(shape, c_dev, tp, [2 ** k for k in range(4, 13)], eff)]
        out["contexts"].append({
            "context": ctx, "homogeneous": homo.as_dict() if homo else None,
            "offloaded": off.as_dict() if off else None,
            "gain": (off.tokens_per_s_per_kusd / homo.tokens_per_s_per_kusd
                     if off and homo else None),
            "sweep": sweep, "min_bandwidth": bw, "compute_nic_gbps": tp * c_dev.nic_gbps,
            "simulation": _simulate(shape, off, ctx, simulate_requests, eff) if off else None})
    return out


def _simulate(shape, est, ctx, n, eff) -> dict:
    """The recommended cell under Poisson load at 80% of its estimated capacity; prompts
    and outputs are ShareGPT-like, scaled so a request's context averages `ctx`."""
    from lamina.costmodel.simulator import (
        AnalyticCosts,
        Request,
        SimConfig,
        poisson_workload,
        simulate,
    )

    cell = est.cell
    m = max(1, round(cell.m))
    costs = AnalyticCosts(shape, cell.compute, cell.tp, cell.memory, eff)
    kv_dev = int(cell.memory.memory_gb * 1e9 * eff.mem_usable // shape.kv_bytes_per_token())
    base = poisson_workload(n, 1.0)
    mean = sum(r.prompt + r.output for r in base) / n
    k = ctx / mean
    scaled = [(max(1, round(r.prompt * k)), max(1, round(r.output * k))) for r in base]
    mean_out = sum(o for _, o in scaled) / n
    rate = 0.8 * est.tokens_per_s / mean_out
    reqs = [Request(r.arrival_s / rate, min(p, kv_dev // 2), min(o, kv_dev // 2))
            for r, (p, o) in zip(base, scaled)]
    cfg = SimConfig(replicas=1, memory_per_replica=m, pipeline=cell.pipeline,
                    max_batch=est.batch, kv_tokens_per_device=kv_dev)
    r = simulate(costs, cfg, reqs)
    return {"requests": n, "rate_per_s": rate, "memory_devices": m, **r.as_dict()}


def _plots(rep: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for c in rep["contexts"]:
        xs = [s["memory_per_compute"] for s in c["sweep"] if s["tokens_per_s_per_kusd"]]
        ys = [s["tokens_per_s_per_kusd"] for s in c["sweep"] if s["tokens_per_s_per_kusd"]]
        line, = ax.plot(xs, ys, marker="o", ms=3, label=f"offloaded, context {c['context']}")
        if c["homogeneous"]:
            ax.axhline(c["homogeneous"]["tokens_per_s_per_kusd"], ls="--", color=line.get_color(),
                       label=f"homogeneous, context {c['context']}")
    ax.set(xlabel=f"{rep['memory']['name']} per {rep['compute']['name']}",
           ylabel="tokens/s per $1k of hardware", title="Throughput per dollar")
    ax.legend(fontsize=8)
    files["throughput_per_dollar"] = _save(fig, out / "throughput_per_dollar.png")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    c0 = rep["contexts"][0]
    ax.plot([b["batch"] for b in c0["min_bandwidth"]], [b["gbps"] for b in c0["min_bandwidth"]],
            marker="o", label="minimum interconnect (paper 4.2)")
    ax.axhline(c0["compute_nic_gbps"], ls="--", color="gray", label="compute NIC(s)")
    ax.set(xscale="log", xlabel="decode batch size", ylabel="GB/s",
           title="Minimum interconnect bandwidth")
    ax.legend(fontsize=8)
    files["min_bandwidth"] = _save(fig, out / "min_bandwidth.png")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    labels = [str(c["context"]) for c in rep["contexts"]]
    h = [c["homogeneous"]["tokens_per_s_per_kusd"] if c["homogeneous"] else 0
         for c in rep["contexts"]]
    o = [c["offloaded"]["tokens_per_s_per_kusd"] if c["offloaded"] else 0
         for c in rep["contexts"]]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], h, 0.4, label="homogeneous")
    ax.bar([x + 0.2 for x in xs], o, 0.4, label="offloaded")
    ax.set_xticks(list(xs), labels)
    ax.set(xlabel="context length", ylabel="tokens/s per $1k", title="Homogeneous vs offloaded")
    ax.legend(fontsize=8)
    files["homogeneous_vs_offloaded"] = _save(fig, out / "homogeneous_vs_offloaded.png")
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def _rows(rep: dict) -> list[list[str]]:
    rows = [["context", "setup", "devices", "pipeline", "batch", "TPOT ms", "tok/s",
             "price $", "tok/s per $1k", "gain"]]
    for c in rep["contexts"]:
        for kind in ("homogeneous", "offloaded"):
            e = c[kind]
            if e is None:
                rows.append([str(c["context"]), kind, "does not fit / misses the SLO"] + [""] * 7)
                continue
            dev = f"{e['tp']} x {e['compute']}" + (
                f" + {e['memory_devices']:g} x {e['memory']}" if e["memory"] else "")
            rows.append([str(c["context"]), kind, dev, e["pipeline"], str(e["batch"]),
                         f"{e['tpot_ms']:.1f}", f"{e['tokens_per_s']:.0f}",
                         f"{e['price_usd']:.0f}", f"{e['tokens_per_s_per_kusd']:.1f}",
                         f"{c['gain']:.2f}x" if kind == "offloaded" and c["gain"] else ""])
    return rows


def _sim_rows(rep: dict) -> list[list[str]]:
    rows = [["context", "requests", "rate/s", "tok/s", "TTFT p50/p99 s", "TPOT p50/p99 ms",
             "compute util", "memory util"]]
    for c in rep["contexts"]:
        s = c["simulation"]
        if s:
            rows.append([str(c["context"]), str(s["requests"]), f"{s['rate_per_s']:.1f}",
                         f"{s['throughput_tok_s']:.0f}",
                         f"{s['ttft_s']['p50']:.3f} / {s['ttft_s']['p99']:.3f}",
                         f"{s['tpot_s']['p50'] * 1e3:.1f} / {s['tpot_s']['p99'] * 1e3:.1f}",
                         f"{s['compute_util']:.0%}", f"{s['memory_util']:.0%}"])
    return rows


def _recommendation(rep: dict) -> str:
    parts = []
    for c in rep["contexts"]:
        e = c["offloaded"]
        if e:
            parts.append(f"context {c['context']}: {e['tp']} x {e['compute']} + "
                         f"{e['memory_devices']:g} x {e['memory']} per cell, pipeline "
                         f"{e['pipeline']}, batch {e['batch']} ({e['tokens_per_s_per_kusd']:.1f} "
                         f"tok/s per $1k, {c['gain']:.2f}x the best homogeneous setup)"
                         if c["gain"] else f"context {c['context']}: offloaded only")
    return "; ".join(parts) or "no configuration meets the constraints"


def write_report(rep: dict, out_dir: str | Path, fmt: str = "html") -> list[Path]:
    import jsonschema

    if fmt not in ("html", "md"):
        raise ValueError(f"format must be 'html' or 'md', got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = dict(rep, plots=_plots(rep, out))
    jsonschema.validate(rep, REPORT_SCHEMA)
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    title = (f"Lamina cost report: {rep['model']['name']} on {rep['compute']['name']} + "
             f"{rep['memory']['name']}")
    slo = f"TPOT bound {rep['tpot_slo_ms']} ms" if rep["tpot_slo_ms"] else "no TPOT bound"
    if fmt == "md":
        lines = [f"# {title}", "", f"Recommended: {_recommendation(rep)}.", "", slo + ".", ""]
        for rows in (_rows(rep), _sim_rows(rep)):
            lines += ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
            lines += ["| " + " | ".join(r) + " |" for r in rows[1:]] + [""]
        lines += [f"![{k}]({v})" for k, v in rep["plots"].items()]
        path = out / "report.md"
        path.write_text("\n".join(lines) + "\n")
    else:
        def table(rows):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in rows[0])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                           for r in rows[1:])
            return f"<table><tr>{head}</tr>{body}</table>"

        imgs = "".join(f'<figure><img src="{html.escape(v)}" alt="{html.escape(k)}">'
                       f"<figcaption>{html.escape(k)}</figcaption></figure>"
                       for k, v in rep["plots"].items())
        doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
               "</title><style>body{font-family:sans-serif;max-width:70em;margin:auto}"
               "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
               "</style></head><body>"
               f"<h1>{html.escape(title)}</h1><p><b>Recommended:</b> "
               f"{html.escape(_recommendation(rep))}.</p><p>{html.escape(slo)}.</p>"
               f"<h2>Best configurations</h2>{table(_rows(rep))}"
               f"<h2>Simulated under Poisson load (80% of estimated capacity)</h2>"
               f"{table(_sim_rows(rep))}<h2>Plots</h2>{imgs}</body></html>")
        path = out / "report.html"
        path.write_text(doc)
    return [path, out / "report.json", *(out / v for v in rep["plots"].values())]
