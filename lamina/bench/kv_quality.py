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


def decode_perplexity(llm, windows: list[list[int]], prefix: int, batch: int = 8) -> dict:
    """Perplexity of each window's tokens after its first `prefix`, every one scored as a
    decode row (teacher forcing: the document's token is fed, whatever was drawn), so a
    decode-time sparsity policy is what the scores see. The prefix is one prompt
    (attended densely; snapkv and h2o score it there). Driven through the engine's
    executor directly, `batch` windows a step, each on its own slots. The drawn token is
    forced to the document's by a +100 logit bias; its logprob (taken before the bias,
    `sampling.sampler.row_logprobs`) is the NLL; a window whose draw was not forced fails
    the run rather than count a wrong token."""
    from lamina import SamplingParams
    from lamina.engine.messages import SeqWork, StepPlan

    ex, nll, step = llm.executor, [], 10 ** 6
    windows = [w for w in windows if len(w) > prefix + 1]

    def params(target):
        return SamplingParams(temperature=0, logit_bias=((target, 100.0),), logprobs=0)

    for at in range(0, len(windows), batch):
        group = windows[at:at + batch]
        ids = [step + i for i in range(len(group))]
        base = [i * len(group[0]) for i in range(len(group))]
        end = min(len(w) for w in group)
        for pos in range(prefix - 1, end - 1):
            first = pos == prefix - 1  # the prompt: positions 0..prefix-1 at once
            lo = 0 if first else pos
            work = tuple(SeqWork(sid, tuple(w[lo:pos + 1]), lo,
                                 tuple(range(b + lo, b + pos + 1)), params=params(w[pos + 1]),
                                 slots_from=lo) for sid, w, b in zip(ids, group, base))
            res = ex.execute(StepPlan(step, work))
            step += 1
            for w, toks, lp in zip(group, res.token_ids, res.logprobs):
                if toks[0] != w[pos + 1]:
                    raise RuntimeError(f"position {pos + 1}: the +100 bias did not force "
                                       f"token {w[pos + 1]} (drew {toks[0]})")
                nll.append(-lp[0][0])
        ex.execute(StepPlan(step, (), released=tuple(ids)))
        step += 1
    return {"tokens": len(nll), "windows": len(windows), "nll": sum(nll) / len(nll),
            "ppl": math.exp(sum(nll) / len(nll))}


def policy_perplexity(llm, config, windows: list[list[int]], prefix: int,
                      batch: int = 8) -> dict:
    """`decode_perplexity` with every memory worker on sparsity `config`; + its seconds."""
    for m in llm.executor.memory:
        m.set_sparsity(config)
    t0 = time.perf_counter()
    return {**decode_perplexity(llm, windows, prefix, batch),
            "seconds": time.perf_counter() - t0}


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


def policy_modes(policies, budgets, layer_budgets,
                 topk_rescore=(0.0,)) -> list[tuple[str, float, str, float]]:
    """(policy, budget, layer budgets, rescore) of each sparsity row, dense first; topk
    once per `topk_rescore` value (the others ignore it: 0)."""
    return [("dense", 1.0, "uniform", 0.0)] + [
        (p, b, lb, r) for p in policies for r in (topk_rescore if p == "topk" else (0.0,))
        for b in budgets for lb in layer_budgets]


def bench_kv_sparsity(model: str | None = None,
                      policies=("streaming", "h2o", "snapkv", "topk", "swa"),
                      budgets=(0.5, 0.2, 0.1), layer_budgets=("uniform", "concentration"),
                      topk_rescore=(0.0, 3.0),
                      lengths=(1024, 2048, 4096, 8192), trials: int = 50,
                      ppl_context: int = 8192, windows: int = 8, batch: int = 8,
                      docs: list[str] | None = None, kv_dtype: str = "float32",
                      out_dir: str | Path = "benchmarks/results") -> dict:
    """Each sparsity policy at each budget and layer-budget rule against dense, on one
    engine (the policy is switched between rows; prompts are prefilled afresh, no prefix
    caching): perplexity of `windows` windows of `ppl_context` tokens of the documents,
    their second halves scored as decode rows (`decode_perplexity`), and pass-key
    retrieval (the prompt attended densely, the answer decoded under the policy). topk
    runs once per `topk_rescore` (`SparsityConfig.rescore`)."""
    from lamina import LLM
    from lamina.memory.sparsity import MEASURED, SparsityConfig
    from lamina.model.prepare import attention_entropy

    docs = docs or default_docs()
    llm = LLM(model, kv_dtype=kv_dtype, prefix_caching=False,
              num_kv_slots=max(32768, batch * ppl_context + 1024, trials * max(lengths)),
              max_step_tokens=max(4096, max(lengths)))
    tok = llm.loaded.tokenizer
    ids = [tok(Path(d).read_text())["input_ids"] for d in docs]
    wins = [d[i:i + ppl_context] for d in ids
            for i in range(0, len(d) - ppl_context + 1, ppl_context)][:windows]
    if not wins:
        raise ValueError(f"no document has {ppl_context} tokens")
    memory = llm.executor.memory
    entropy = (attention_entropy(llm.loaded.model, tok, memory[0].pool.config.num_layers)
               if set(MEASURED) & set(layer_budgets) else None)
    rows = []
    for policy, budget, lb, rescore in policy_modes(policies, budgets, layer_budgets,
                                                    topk_rescore):
        cfg = SparsityConfig(policy, budget, lb, rescore=rescore,
                             layer_weights=entropy if lb in MEASURED else None)
        ppl = policy_perplexity(llm, cfg, wins, ppl_context // 2, batch)
        t0 = time.perf_counter()
        acc = passkey(llm, tok, lengths, trials)
        rows.append({"policy": policy, "budget": budget, "layer_budgets": lb,
                     "rescore": rescore, **ppl,
                     "passkey": acc, "passkey_mean": sum(acc.values()) / len(acc),
                     "seconds": ppl["seconds"] + time.perf_counter() - t0})
        print(f"{policy} {budget:g} {lb} rescore {rescore:g}: decode ppl {ppl['ppl']:.4f} "
              f"over {ppl['tokens']} tokens, pass-key "
              + " ".join(f"{n}:{a:.0%}" for n, a in acc.items()), flush=True)
    llm.shutdown()
    base = rows[0]
    for r in rows:
        r["ppl_vs_dense"] = r["ppl"] / base["ppl"] - 1
        r["passkey_points_vs_dense"] = 100 * (r["passkey_mean"] - base["passkey_mean"])
    table = [["policy", "budget", "layers", "rescore", "decode ppl", "vs dense",
              *[f"pass-key {n}" for n in lengths], "pass-key mean", "s"]]
    for r in rows:
        table.append([r["policy"], f"{r['budget']:g}", r["layer_budgets"],
                      f"{r['rescore']:g}", f"{r['ppl']:.4f}",
                      f"{r['ppl_vs_dense']:+.2%}", *[f"{r['passkey'][n]:.0%}" for n in lengths],
                      f"{r['passkey_mean']:.1%}", f"{r['seconds']:.0f}"])
    res = {"model": model or "SmolLM2-135M-Instruct", "cpu": cpu_name(), "kv_dtype": kv_dtype,
           "docs": [os.path.basename(d) for d in docs], "ppl_context": ppl_context,
           "windows": len(wins), "lengths": list(lengths), "trials": trials,
           "entropy_weights": entropy, "rows": rows}
    out = Path(out_dir)
    jp, mp = _write(out, "kv_sparsity", res, table)
    png = _plot_sparsity(rows, out / "kv_sparsity.png")
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp}, {mp} and {png}")
    return res


def _plot_sparsity(rows, path: Path) -> Path:
    """Quality vs budget, one line per policy (solid: uniform budgets, dashed: per layer);
    dense as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    dense = rows[0]
    for ax, key, label in ((axes[0], "ppl", "decode perplexity (lower is better)"),
                           (axes[1], "passkey_mean", "pass-key accuracy (mean over lengths)")):
        ax.axhline(dense[key], color="black", lw=1, label="dense")
        def name(r):  # a rescored topk is a policy of its own here
            return r["policy"] + (f" rescore {r['rescore']:g}" if r.get("rescore") else "")

        lines = sorted({(name(r), r["layer_budgets"]) for r in rows[1:]})
        colors = {p: f"C{i}" for i, p in enumerate(sorted({p for p, _ in lines}))}
        for pol, lb in lines:
            pts = sorted((r["budget"], r[key]) for r in rows[1:]
                         if (name(r), r["layer_budgets"]) == (pol, lb))
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", color=colors[pol],
                    ls="-" if lb == "uniform" else "--", label=f"{pol} ({lb})")
        ax.set_xscale("log")
        ax.set_xlabel("KV budget (fraction of the context)")
        ax.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
