"""Layer budget rules beyond `lamina bench kv-sparsity`'s (uniform, pyramid, entropy,
concentration), tried against uniform at the same total: the first layer(s) kept whole (seed 003's
"full cache in the low layers"), and a greedy allocation that minimizes the summed
relative error of the layers' attention outputs under an exact shared top-b selection
(measured on 1024 tokens of a seed paper through HF's eager attention). Each rule is
given to `SparsityConfig` as `layer_weights`; perplexity is `decode_perplexity` on the
same windows as the bench. Not a library feature: a probe of which rule could pay.

    .venv/bin/python benchmarks/layer_budget_probe.py [--budget 0.2] [--rescore 3]
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from lamina import LLM
from lamina.bench.kv_quality import default_docs, policy_perplexity
from lamina.memory.sparsity import SparsityConfig

GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0)


def output_errors(model, ids: torch.Tensor, head_dim: int) -> np.ndarray:
    """[L, len(GRID)]: each layer's mean relative attention-output error when every query
    (from position 256, every 16th) attends only its top-b keys by attention summed over
    heads, renormalized."""
    vs = {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda mod, i, o, k=k: vs.__setitem__(k, o.detach()))
        for k, layer in enumerate(model.model.layers)]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions  # L x [1, H, T, T]
    for h in hooks:
        h.remove()
    T = ids.shape[1]
    out = []
    for layer, a in enumerate(att):
        p = a[0].float()
        v = vs[layer][0].view(T, -1, head_dim)
        vh = v.repeat_interleave(p.shape[0] // v.shape[1], dim=1).transpose(0, 1)  # [H, T, D]
        row = []
        for b in GRID:
            e = []
            for i in range(256, T, 16):
                pi, vi = p[:, i, :i + 1], vh[:, :i + 1]
                o = torch.einsum("hn,hnd->hd", pi, vi)
                top = torch.topk(pi.sum(0), max(1, int(np.ceil(b * (i + 1))))).indices
                ps = pi[:, top] / pi[:, top].sum(-1, keepdim=True)
                os_ = torch.einsum("hn,hnd->hd", ps, vi[:, top])
                e.append(float(((os_ - o).norm(dim=-1) / o.norm(dim=-1)).mean()))
            row.append(np.mean(e))
        out.append(row)
    return np.array(out)


def allocate(errors: np.ndarray, budget: float) -> list[float]:
    """Per-layer fractions from GRID with mean `budget`: start every layer at the
    smallest, then raise the layer whose error falls most per unit of budget."""
    idx = np.zeros(len(errors), int)
    while sum(GRID[j] for j in idx) < budget * len(errors) - 1e-9:
        gain = [(errors[k, j] - errors[k, j + 1]) / (GRID[j + 1] - GRID[j])
                if j + 1 < len(GRID) else -np.inf for k, j in enumerate(idx)]
        idx[int(np.argmax(gain))] += 1
    return [GRID[j] for j in idx]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--rescore", type=float, default=3.0)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(None, num_kv_slots=40000, prefix_caching=False, max_step_tokens=4096)
    tok = llm.loaded.tokenizer
    docs = [tok(Path(d).read_text())["input_ids"] for d in default_docs()]
    wins = [d[i:i + args.context] for d in docs
            for i in range(0, len(d) - args.context + 1, args.context)][:args.windows]
    layers = llm.executor.memory[0].pool.config.num_layers
    ids = torch.tensor([docs[1][:1024]])
    err = output_errors(llm.loaded.model, ids, llm.loaded.config.hidden_size
                        // llm.loaded.config.num_attention_heads)
    big = 1000.0  # water-filling caps these layers at 1, the rest share what is left
    rules = {"uniform": None, "layer 0 whole": [big] + [1.0] * (layers - 1),
             "layers 0-1 whole": [big, big] + [1.0] * (layers - 2),
             "least output error": allocate(err, args.budget)}
    print("allocation by output error:", rules["least output error"])
    for name, weights in rules.items():
        cfg = SparsityConfig("topk", args.budget, "entropy" if weights else "uniform",
                             layer_weights=weights, rescore=args.rescore)
        r = policy_perplexity(llm, cfg, wins, args.context // 2)
        print(f"{name}: decode ppl {r['ppl']:.4f} over {r['tokens']} tokens "
              f"({r['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
