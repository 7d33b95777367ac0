"""How many sequences a memory worker of a fixed size holds: `lamina bench kv-capacity`.

Data in: a pool budget in bytes (`kv_pool_bytes`), a sequence length, KV modes (a dtype,
optionally with a sparsity policy and budget: `float32:streaming:0.2`). Data out:
per mode, the slots the budget buys and the most sequences that ran at once with their
whole prompt's KV in the pool, counted by admitting them (not computed from the bytes);
JSON and Markdown.

Per mode, one engine (local executor, one memory worker, prefix caching off so no two
sequences share a slot) gets `expected + extra` requests of `length` tokens each: a
prompt of distinct random token ids and `new` greedy tokens, `new` large enough that
every admitted prompt is prefilled (in chunks of `max_step_tokens`) before the first
sequence finishes (with a sparsity policy that gives slots back, long enough for every
request to be admitted while the first ones still run). After every step the bench
counts the running sequences that have drawn a token. The most at once is the capacity;
the extra requests prove the pool was full (they wait, or preempt).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name


def admitted_at_once(llm, length: int, requests: int, seed: int = 0,
                     new: int | None = None) -> dict:
    """`requests` sequences of `length` tokens (prompt + `new`) through `llm`'s engine.
    `new` None: enough for every prompt to be prefilled before the first one finishes."""
    from lamina import SamplingParams

    rng = random.Random(seed)
    eng = llm.engine
    new = new or -(-requests * length // llm.config.max_step_tokens) + 4
    if new >= length:
        raise ValueError(f"{requests} sequences of {length} tokens: too short to keep "
                         f"them all alive while the others are prefilled")
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for _ in range(requests):
        eng.add_request([rng.randrange(1000, 20000) for _ in range(length - new)], params)
    most, steps, preempted = 0, 0, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                preempted += o.metrics["preemptions"]
        steps += 1
        most = max(most, sum(1 for s in eng.scheduler.running if s.output))
    return {"most_at_once": most, "steps": steps, "preemptions": preempted}


def parse_mode(mode: str) -> dict:
    """'float32' -> that KV dtype; 'float32:streaming:0.2' -> with that KV policy and
    budget (streaming, h2o and snapkv give back the slots they will never read again:
    `kv_evict`)."""
    dtype, *sparse = mode.split(":")
    if not sparse:
        return {"kv_dtype": dtype}
    if len(sparse) != 2:
        raise ValueError(f"KV mode {mode!r}: use DTYPE or DTYPE:POLICY:BUDGET")
    budget = float(sparse[1]) if "." in sparse[1] else int(sparse[1])
    return {"kv_dtype": dtype, "kv_sparsity": sparse[0], "kv_budget": budget}


def bench_kv_capacity(model: str | None = None, pool_bytes: int = 1 << 30,
                      length: int = 2048,
                      modes=("float32", "bfloat16", "int8", "float32:streaming:0.2",
                             "float32:h2o:0.2", "float32:snapkv:0.2"),
                      extra: int = 4, out_dir: str | Path = "benchmarks/results") -> dict:
    from lamina import LLM

    rows = []
    for mode in modes:
        t0 = time.perf_counter()
        kw = parse_mode(mode)
        llm = LLM(model, kv_pool_bytes=pool_bytes, prefix_caching=False,
                  max_batch=1024, max_step_tokens=max(16384, length), **kw)
        slots = llm.config.num_kv_slots
        per_token = llm.executor.memory[0].pool.config.bytes_per_slot
        expected = slots // length
        budget = kw.get("kv_budget")
        # a sparse mode keeps about its budget of each sequence once it decodes: ask
        # for enough requests to fill the pool at that rate
        want = expected if budget is None else int(slots / (length * budget
                                                            if isinstance(budget, float)
                                                            else budget))
        # a sparse mode's prompts need their whole length until their first decode step
        # gives the rest back: about one is admitted a step, so each must live that long
        r = admitted_at_once(llm, length, want + extra,
                             new=None if budget is None else want + extra + 4)
        llm.shutdown()
        rows.append({"mode": mode, **kw, "slots": slots, "bytes_per_token": per_token,
                     "expected": expected, **r, "seconds": time.perf_counter() - t0})
        print(f"{mode}: {slots} slots, {r['most_at_once']} sequences of {length} at once "
              f"(expected {expected}), {r['preemptions']} preemptions", flush=True)
    base = rows[0]["most_at_once"] or 1
    table = [["KV", "slots", "bytes/token", "sequences at once", f"x {rows[0]['mode']}",
              "preemptions", "s"]]
    for r in rows:
        table.append([r["mode"], str(r["slots"]), str(r["bytes_per_token"]),
                      str(r["most_at_once"]), f"{r['most_at_once'] / base:.2f}",
                      str(r["preemptions"]), f"{r['seconds']:.0f}"])
    res = {"model": model or "SmolLM2-135M-Instruct", "cpu": cpu_name(),
           "pool_bytes": pool_bytes, "length": length, "rows": rows}
    jp, mp = _write(Path(out_dir), "kv_capacity", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"pool {pool_bytes / 2 ** 20:.0f} MiB per memory worker; wrote {jp} and {mp}")
    return res
