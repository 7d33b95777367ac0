"""What KV compression costs in quality: `lamina bench kv-quality`.

Data in: long English documents (default: the seed papers beside the repository,
`../shared/seeds/*.txt`, or `--docs`), the model (default SmolLM2). Data out: per KV
mode, perplexity and pass-key retrieval accuracy; JSON, Markdown and a PNG.

Modes: the model's weights stay fp32; the memory workers' pools are `float32` (dense
fp32, the reference), `bfloat16` or `int8` (`kernels/quant.py`), each a fresh engine in
this process, served through the pools and attention kernels a deployment uses.
- Perplexity: each document's tokens, whole, cut into windows of `ppl_context` - 1
  tokens (the last one shorter; the one token drawn fills the context); each window is
  one request whose prompt log-probabilities
  (`prompt_logprobs=0`) give every token's NLL after the first; perplexity =
  exp(token-weighted mean NLL) over all windows of all documents.
- Pass-key retrieval: per context length (prompt and the 8 new tokens), `trials`
  prompts of filler sentences with
  "The pass key is NNNNN. Remember it." placed at a seeded random depth, ending with
  "What is the pass key? The pass key is"; greedy, 8 new tokens; a trial passes when
  the key's digits come out. The same prompts in every mode.
"""
from __future__ import annotations

import glob
import math
import os
import random
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name

SEEDS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "seeds")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
          "back again. ")
HEAD = ("There is an important piece of information hidden inside a lot of irrelevant "
        "text. Find it and memorize it; you will be asked about it.\n")
TAIL = "\nWhat is the pass key? The pass key is"


def default_docs() -> list[str]:
    docs = sorted(glob.glob(os.path.join(os.path.abspath(SEEDS), "*.txt")))
    if not docs:
        raise FileNotFoundError(f"no documents: {os.path.abspath(SEEDS)} has no *.txt; "
                                f"give --docs FILE ...")
    return docs


def passkey_prompts(tok, length: int, trials: int, seed: int = 0) -> list[tuple[list, str]]:
    """`trials` (prompt ids of ~`length` tokens, key) pairs, key depth uniform in the
    filler."""
    rng = random.Random(seed * 100003 + length)
    head, tail = tok(HEAD)["input_ids"], tok(TAIL, add_special_tokens=False)["input_ids"]
    fill = tok(FILLER, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(trials):
        key = str(rng.randint(10000, 99999))
        needle = tok(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                     add_special_tokens=False)["input_ids"]
        n = max(0, length - len(head) - len(tail) - len(needle))
        body = (fill * (n // len(fill) + 1))[:n]
        depth = rng.randint(0, n // len(fill)) * len(fill)  # at a sentence boundary
        out.append((head + body[:depth] + needle + body[depth:] + tail, key))
    return out


def perplexity(llm, docs_ids: list[list[int]], ctx: int) -> dict:
    from lamina import SamplingParams

    w = ctx - 1  # the drawn token fills the context
    windows = [ids[i:i + w] for ids in docs_ids for i in range(0, len(ids), w)]
    windows = [w for w in windows if len(w) > 1]
    p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate(windows, p, use_tqdm=False)
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return {"tokens": len(nll), "windows": len(windows), "nll": sum(nll) / len(nll),
            "ppl": math.exp(sum(nll) / len(nll))}


def passkey(llm, tok, lengths, trials: int) -> dict:
    from lamina import SamplingParams

    p = SamplingParams(max_tokens=8, temperature=0)
    acc = {}
    for n in lengths:
        cases = passkey_prompts(tok, n - p.max_tokens, trials)
        outs = llm.generate([c for c, _ in cases], p, use_tqdm=False)
        acc[n] = sum(k in o.text for (_, k), o in zip(cases, outs)) / len(cases)
    return acc


def bench_kv_quality(model: str | None = None, modes=("float32", "bfloat16", "int8"),
                     lengths=(1024, 2048, 4096, 8192), trials: int = 50,
                     ppl_context: int = 8192, docs: list[str] | None = None,
                     max_doc_tokens: int | None = None,
                     out_dir: str | Path = "benchmarks/results") -> dict:
    from lamina import LLM

    docs = docs or default_docs()
    rows = []
    ids = None
    for mode in modes:
        t0 = time.perf_counter()
        llm = LLM(model, kv_dtype=mode, num_kv_slots=max(32768, 2 * ppl_context),
                  max_step_tokens=max(4096, max(lengths)))
        tok = llm.loaded.tokenizer
        if ids is None:
            ids = [tok(Path(d).read_text())["input_ids"][:max_doc_tokens] for d in docs]
        ppl = perplexity(llm, ids, ppl_context)
        acc = passkey(llm, tok, lengths, trials)
        llm.shutdown()
        rows.append({"kv_dtype": mode, **ppl, "passkey": acc,
                     "passkey_mean": sum(acc.values()) / len(acc),
                     "seconds": time.perf_counter() - t0})
        print(f"{mode}: ppl {ppl['ppl']:.4f} over {ppl['tokens']} tokens, pass-key "
              + " ".join(f"{n}:{a:.0%}" for n, a in acc.items()), flush=True)
    base = rows[0]
    for r in rows:
        r["ppl_vs_first"] = r["ppl"] / base["ppl"] - 1
        r["passkey_points_vs_first"] = 100 * (r["passkey_mean"] - base["passkey_mean"])
    table = [["KV", "perplexity", f"vs {base['kv_dtype']}",
              *[f"pass-key {n}" for n in lengths], "pass-key mean", "s"]]
    for r in rows:
        table.append([r["kv_dtype"], f"{r['ppl']:.4f}", f"{r['ppl_vs_first']:+.3%}",
                      *[f"{r['passkey'][n]:.0%}" for n in lengths],
                      f"{r['passkey_mean']:.1%}", f"{r['seconds']:.0f}"])
    res = {"model": model or "SmolLM2-135M-Instruct", "cpu": cpu_name(),
           "docs": [os.path.basename(d) for d in docs], "ppl_context": ppl_context,
           "lengths": list(lengths), "trials": trials, "rows": rows}
    out = Path(out_dir)
    jp, mp = _write(out, "kv_quality", res, table)
    png = _plot(rows, lengths, out / "kv_quality.png")
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp}, {mp} and {png}")
    return res


def _plot(rows, lengths, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([r["kv_dtype"] for r in rows], [r["ppl"] for r in rows], color="tab:blue")
    lo = min(r["ppl"] for r in rows)
    a.set_ylim(lo * 0.98, max(r["ppl"] for r in rows) * 1.01)
    a.set_ylabel("perplexity (lower is better)")
    a.set_title("held-out text, whole documents")
    for r in rows:
        b.plot(list(lengths), [100 * r["passkey"][n] for n in lengths], marker="o",
               label=r["kv_dtype"])
    b.set_xscale("log", base=2)
    b.set_ylim(-5, 105)
    b.set_xlabel("context tokens")
    b.set_ylabel("pass-key accuracy %")
    b.set_title("pass-key retrieval")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
