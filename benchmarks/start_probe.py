"""Where a deployment's start goes: the phases of a fresh process's model preparation,
and `LLM(...)` on the local and the Ray executor.

    python benchmarks/start_probe.py [--repeat 3] [--memory-workers 2]
                                     [--no-ray | --ray-only] [--first-load] [--out DIR]

Every start pays the compute side's preparation in a fresh process: the local executor
in the caller's, each Ray compute worker (and its replacement after a failure) in its
own. Each measurement below runs in a new child process (nothing warm from an earlier
one but the OS page cache and the on-disk caches: the converted model folder, the trace
store, the built kernels), one after another, nothing else running:

- `phases`: importing torch and lamina, `load` (the cached HF conversion of the GGUF),
  `prepare_split` (trace, min-cut split, dense packing, pointwise fusion; `of which
  trace`: the graph, from the trace store once this machine has traced the model), one
  torch thread: what a compute worker does before it answers, loading the model the
  full way (transformers). `phases weights-only`: the same from the weights alone, as a
  compute worker starts once a full load here recorded how (`lamina.model.quick_load`);
  each round runs the full one, then this. `ratio`: the median of the rounds' total
  full / weights-only.
- `local`: `LLM(num_memory_workers=N)` whole (the phases plus the pools).
- `ray`: `LLM(executor="ray", num_memory_workers=N)` whole: a local Ray instance
  started (`ray_init`), the placement group, the workers started and wired; `ray full
  load` the same with `LAMINA_WEIGHTS_ONLY=0` (run first in each round), `ray ratio`
  the rounds' median `llm` full / weights-only.

- `first` (--first-load, only that): a machine's first load of the GGUF, with an empty
  cache folder: `load` (the file parsed once, the HF folder written) against
  transformers' own GGUF load of the config, model and tokenizer (the baseline).

Medians of --repeat per number. Nothing here is a target. Writes start_probe.json and
.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from lamina.bench.common import _write, cpu_name

PHASES = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from lamina.model.loader import load
from lamina.model.prepare import prepare_split
from lamina.model.quick_load import load_weights_only, remember
t1 = time.perf_counter()
quick = sys.argv[1] == "weights_only"
lm = load_weights_only(None) if quick else load(None, with_tokenizer=False)
if lm is None:
    sys.exit("no weights-only record on this machine (the full run writes it)")
t2 = time.perf_counter()
prep = prepare_split(lm.model)
t3 = time.perf_counter()
if not quick:
    remember(lm, torch.float32)
print("RESULT", json.dumps({"import": t1 - t0, "load": t2 - t1, "prepare_split": t3 - t2,
                            "of which trace": prep.split.timings["trace_s"],
                            "total": t3 - t0,
                            "transformers imported": int("transformers" in sys.modules)}))
'''

LLM_START = r'''
import json, sys, time
t0 = time.perf_counter()
from lamina import LLM
from lamina.cluster.connect import connect_ray
executor, m = sys.argv[1], int(sys.argv[2])
t1 = time.perf_counter()
out = {"import": t1 - t0}
if executor == "ray":
    connect_ray()  # the local instance the executor would start
    out["ray_init"] = time.perf_counter() - t1
t2 = time.perf_counter()
llm = LLM(executor=executor, num_memory_workers=m)
out["llm"] = time.perf_counter() - t2
llm.shutdown()
print("RESULT", json.dumps(out))
'''

FIRST = r'''
import json, sys, tempfile, time
t0 = time.perf_counter()
import os
import torch
torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from lamina.model.loader import load, resolve
t1 = time.perf_counter()
if sys.argv[1] == "lamina":
    os.environ["LAMINA_CACHE_DIR"] = tempfile.mkdtemp()
    load(None)
else:
    folder, gguf = resolve(None)
    kw = {"gguf_file": gguf, "local_files_only": True}
    AutoConfig.from_pretrained(folder, **kw)
    AutoModelForCausalLM.from_pretrained(folder, **kw)
    AutoTokenizer.from_pretrained(folder, **kw)
print("RESULT", json.dumps({sys.argv[1]: time.perf_counter() - t1}))
'''


def child(code: str, *args: str, env: dict | None = None) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, timeout=900)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"child failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory-workers", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--ray-only", action="store_true", help="only the `ray` start")
    ap.add_argument("--first-load", action="store_true",
                    help="only a first load of the GGUF against transformers' own")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    m = str(args.memory_workers)
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "repeat": args.repeat,
              "memory_workers": args.memory_workers}
    if args.first_load:  # one after the other in each round: a slow spell hits both
        runs = [{**child(FIRST, "transformers"), **child(FIRST, "lamina")}
                for _ in range(args.repeat)]
        result["first"] = medians(runs)
    else:
        if not args.ray_only:  # a round: the full load (which records), then the quick
            rounds = [(child(PHASES, "full"), child(PHASES, "weights_only"))
                      for _ in range(args.repeat)]
            result["phases"] = medians([full for full, _ in rounds])
            result["phases weights-only"] = medians([quick for _, quick in rounds])
            result["ratio"] = {"total, full / weights-only": statistics.median(
                full["total"] / quick["total"] for full, quick in rounds)}
            result["local"] = medians([child(LLM_START, "local", m)
                                       for _ in range(args.repeat)])
        if not args.no_ray:  # a round: compute workers loading the full way, then not
            off = {"LAMINA_WEIGHTS_ONLY": "0"}
            rounds = [(child(LLM_START, "ray", m, env=off), child(LLM_START, "ray", m))
                      for _ in range(args.repeat)]
            result["ray full load"] = medians([full for full, _ in rounds])
            result["ray"] = medians([quick for _, quick in rounds])
            result["ray ratio"] = {"llm, full / weights-only": statistics.median(
                full["llm"] / quick["llm"] for full, quick in rounds)}
    table = [["what", "part", "s"]]
    for what in ("first", "phases", "phases weights-only", "ratio", "local", "ray full load",
                 "ray", "ray ratio"):
        for part, s in result.get(what, {}).items():
            table.append([what, part, f"{s:.2f}"])
            print(" | ".join(table[-1]), flush=True)
    for path in _write(Path(args.out), "start_probe", result, table):
        print("wrote", path)


if __name__ == "__main__":
    main()
