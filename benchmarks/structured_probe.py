"""What structured output costs a batch (`lamina/sampling/structured.py`).

    python benchmarks/structured_probe.py [--batch 1 16 64] [--repeat 3] [--out DIR]

SmolLM2 on the local executor (`LLM`, CPU, one memory worker, one torch thread). B
prompts asking for a customer record; each answer held to a JSON schema (greedy, at most
96 tokens). Side by side, per B: the same prompts without a constraint, each request
cut at the number of tokens its constrained answer took (`ignore_eos`), so both runs
draw the same tokens per request. Reported: wall time of each (medians of --repeat) and
their ratio; the engine's time building the step's masks (`LLMEngine._guided`, ms a
step, median) and feeding the drawn tokens to the matchers is inside the constrained
time; how many answers parse and validate (`jsonschema`); one grammar's check and
compile time; the sampler alone on B greedy rows under random masks (`sampler_ms`).
Writes structured_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import numpy as np
import torch

from lamina import LLM, SamplingParams, StructuredOutputs
from lamina.bench.common import _write, clocked, cpu_name
from lamina.kernels import argmax_rows
from lamina.sampling.sampler import mask_rows, sample_rows

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                         "email": {"type": "string", "maxLength": 40},
                         "plan": {"enum": ["free", "pro", "team"]},
                         "active": {"type": "boolean"}},
          "required": ["id", "name", "email", "plan", "active"], "additionalProperties": False}
NEW = 96


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list]:
    """-> (seconds to finish every request, the outputs in order)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def sampler_ms(rows: int, vocab: int, repeat: int = 21) -> dict:
    """Greedy masked rows alone: `rows` random fp32 logit rows, each with a random mask
    (half the tokens, no pattern: the worst case for branching code); the median ms of
    `sample_rows` (the compiled `masked_argmax_rows`) and of the torch path it replaced
    (`mask_rows`: a masked fp32 copy, four rows at a time, then an argmax); free rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    masks = [np.packbits(torch.rand(vocab, generator=g).numpy() < 0.5,
                         bitorder="little").tobytes() for _ in range(rows)]
    p = [SamplingParams(temperature=0)] * rows

    def torch_path():
        for at in range(0, rows, 4):
            argmax_rows(mask_rows(logits[at:at + 4], masks[at:at + 4]))

    runs = {"kernel": lambda: sample_rows(logits, p, [(0,)] * rows, [1] * rows, None, masks),
            "torch": torch_path,
            "free": lambda: sample_rows(logits, p, [(0,)] * rows, [1] * rows)}
    out = {}
    for name, fn in runs.items():
        took = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t)
        out[name] = 1e3 * statistics.median(took)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(num_kv_slots=16384, max_batch=max(args.batch))
    eng = llm.engine
    spec = StructuredOutputs(json=SCHEMA)
    t = time.perf_counter()
    eng.guides.check(spec)  # the first: builds the tokenizer's tables too
    first_check = time.perf_counter() - t
    t = time.perf_counter()
    eng.guides.guide(eng.guides.check(spec))
    compile_s = time.perf_counter() - t
    masks = clocked(eng, "_guided")
    rows, table = [], [["B", "free s", "structured s", "x", "tokens", "mask ms/step",
                        "valid"]]
    for b in args.batch:
        prompts = [f"Customer record #{1000 + 37 * i} of our database, as JSON:" for i in
                   range(b)]
        held = SamplingParams(max_tokens=NEW, temperature=0, structured_outputs=spec)
        t_free, t_held, mask_ms, valid, tokens = [], [], [], 0, 0
        for _ in range(args.repeat):
            masks.clear()
            s, outs = run(llm, prompts, [held] * b)
            t_held.append(s)
            mask_ms.append(1e3 * statistics.median(masks))
            tokens = sum(len(o.token_ids) for o in outs)
            valid = 0
            for o in outs:
                try:
                    jsonschema.validate(json.loads(o.text), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            free = [SamplingParams(max_tokens=len(o.token_ids), temperature=0,
                                   ignore_eos=True) for o in outs]
            s, _ = run(llm, prompts, free)
            t_free.append(s)
        f, h = statistics.median(t_free), statistics.median(t_held)
        m = statistics.median(mask_ms)
        rows.append({"batch": b, "free_s": f, "structured_s": h, "ratio": h / f,
                     "tokens": tokens, "mask_ms_per_step": m, "valid": valid})
        table.append([str(b), f"{f:.2f}", f"{h:.2f}", f"{h / f:.3f}", str(tokens),
                      f"{m:.2f}", f"{valid}/{b}"])
        print(" | ".join(table[-1]), flush=True)
    result = {"cpu": cpu_name(), "threads": 1, "max_new_tokens": NEW, "repeat": args.repeat,
              "first_check_s": first_check, "check_and_compile_s": compile_s, "rows": rows}
    print(f"first grammar check (tokenizer tables) {first_check:.3f} s; a check and a "
          f"matcher after it {1e3 * compile_s:.2f} ms")
    result["sampler_ms"] = {b: sampler_ms(b, eng.vocab_size) for b in args.batch}
    for b, ms in result["sampler_ms"].items():
        print(f"sampler, {b} greedy rows under random masks: compiled masked argmax "
              f"{ms['kernel']:.2f} ms, masked fp32 copy + argmax {ms['torch']:.2f} ms; "
              f"unmasked {ms['free']:.2f} ms")
    for path in _write(Path(args.out), "structured_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
