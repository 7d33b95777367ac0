"""What finding the request behind failing steps costs (`lamina/engine/culprit.py`).

    python benchmarks/culprit_probe.py [--batch 8 32] [--repeat 3] [--executor local|ray]
                                       [--out DIR]

SmolLM2 on the local executor (`LLM`, CPU, one memory worker) or on the Ray executor
(one compute worker, two memory workers, a local Ray cluster). B good requests (64-token
prompts cut from `lamina bench e2e`'s text at different offsets, 32 new tokens, greedy)
and, after two steps, one poison request: its prompt holds a token that makes layer 2's
dense slice raise in every step that feeds it (`FaultPlan(compute_layer=2,
layer_token=...)`), an error that names no sequence. Per B, side by side: the wall time
to finish every request without the poison and with it (medians of --repeat), the failed
steps (each a recovery: max_recoveries of them before the search, then the search's own),
the median time one `recover` took, the positions whose KV the recoveries kept in the
pools they kept (`LLMEngine.kv_kept_tokens`, per poisoned run: the rest of the requeued
sequences' KV is recomputed), and whether the good requests' tokens are the same in both
runs (they must be). Nothing here is a target; it says
what a poison request costs the others. Writes culprit_probe.json (culprit_probe_ray.json
on Ray) and .md into --out.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, clocked, cpu_name
from lamina.bench.e2e import _prompts
from lamina.faults import FaultPlan

NEW = 32


def run(llm: LLM, prompts: list[list[int]], poison: list[int] | None) -> tuple[float, list]:
    """-> (seconds to finish every request, the good requests' token ids)."""
    eng, p = llm.engine, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    ids = [eng.add_request(x, p) for x in prompts]
    outs: dict = {}
    for _ in range(2):
        outs.update({o.request_id: o for o in eng.step()})
    if poison is not None:
        eng.add_request(poison, p)
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    return time.perf_counter() - t, [outs[i].token_ids for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--executor", choices=["local", "ray"], default="local")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bad = 1999  # a token id the good prompts do not hold (checked below)
    kw = dict(num_kv_slots=8192, max_batch=64, max_step_tokens=4096, executor=args.executor,
              num_memory_workers=2 if args.executor == "ray" else 1)
    # one engine for both runs: the fault only fires on steps that feed the poison token
    llm = LLM(faults=FaultPlan(compute_layer=2, layer_token=bad), **kw)
    eng, recover_s = llm.engine, clocked(llm.executor, "recover")
    rows, table = [], [["B", "clean s", "with poison s", "x", "failed steps",
                        "of them the search's", "recover s", "KV kept", "same tokens"]]
    for b in args.batch:
        prompts = _prompts(llm.loaded.tokenizer, b, 64)
        assert all(bad not in x for x in prompts)
        poison = prompts[0][:63] + [bad]
        t_clean, t_poison, failed, searched, kept, same = [], [], [], [], [], True
        for _ in range(args.repeat):
            s, want = run(llm, prompts, None)
            t_clean.append(s)
            n0, max_rec = eng.num_recoveries, eng.config.max_recoveries
            k0 = getattr(eng, "kv_kept_tokens", 0)  # (0 on engines that kept none)
            s, got = run(llm, prompts, poison)
            t_poison.append(s)
            failed.append(eng.num_recoveries - n0)
            kept.append(getattr(eng, "kv_kept_tokens", 0) - k0)
            searched.append(failed[-1] - (max_rec + 1))
            same &= got == want
        c, p = statistics.median(t_clean), statistics.median(t_poison)
        r = statistics.median(recover_s)
        recover_s.clear()
        rows.append({"batch": b, "clean_s": c, "poison_s": p, "ratio": p / c,
                     "failed_steps": failed, "search_failed_steps": searched,
                     "recover_s": r, "kv_kept_tokens": kept, "same_tokens": same})
        table.append([str(b), f"{c:.2f}", f"{p:.2f}", f"{p / c:.2f}",
                      str(statistics.median(failed)), str(statistics.median(searched)),
                      f"{r:.3f}", str(statistics.median(kept)), "yes" if same else "NO"])
        print(" | ".join(table[-1]), flush=True)
    result = {"cpu": cpu_name(), "threads": 1, "new_tokens": NEW, "repeat": args.repeat,
              "executor": args.executor, "rows": rows}
    name = "culprit_probe" + ("_ray" if args.executor == "ray" else "")
    for path in _write(Path(args.out), name, result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
