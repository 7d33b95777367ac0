"""Where KV sparsity's perplexity limit is: decode perplexity with an oracle selection.

Each decode row attends to its exact top `budget` keys by attention (summed over heads,
or the union of each head's top keys), optionally with the first layers dense, against
the `topk` policy, on windows of the first seed paper (`lamina bench kv-sparsity`'s
teacher-forced harness). Not a library feature: the oracle reads every key.

    .venv/bin/python benchmarks/sparsity_oracle.py [--context 512] [--budget 0.2]
"""
import argparse
from pathlib import Path

import torch

import lamina.memory.sparsity as S
from lamina import LLM
from lamina.bench.kv_quality import default_docs, policy_perplexity

MODE: dict = {}


def _row(self, layer, sid, q, slots, n, t, kp, key_scales, _policy=S.Sparsifier._decode_row):
    if layer < MODE.get("dense_layers", 0):
        return None
    if not MODE.get("oracle"):
        return _policy(self, layer, sid, q, slots, n, t, kp, key_scales)
    if t >= n:
        return None
    keys = S._keys(kp, torch.from_numpy(slots), key_scales)
    p = torch.softmax(S._logits(q.q[None], keys, q.scale, q.softcap)[0], -1)  # [Hq, n]
    if MODE["oracle"] == "sum":
        return torch.topk(p.sum(0), t).indices.sort().values
    per = max(1, t // p.shape[0])  # each head's top keys, united
    return torch.topk(p, per, dim=-1).indices.flatten().unique()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.2)
    args = ap.parse_args()
    llm = LLM(None, num_kv_slots=40000, prefix_caching=False)
    ids = llm.loaded.tokenizer(Path(default_docs()[0]).read_text())["input_ids"][:4096]
    wins = [ids[i:i + args.context] for i in range(0, 4096, args.context)]
    S.Sparsifier._decode_row = _row
    for name, mode in (("dense", None), ("topk", {}), ("oracle-sum", {"oracle": "sum"}),
                       ("oracle-per-head-union", {"oracle": "head"}),
                       ("topk, layers 0-1 dense", {"dense_layers": 2}),
                       ("oracle-sum, layers 0-1 dense", {"oracle": "sum", "dense_layers": 2})):
        MODE.clear()
        MODE.update(mode or {})
        cfg = S.SparsityConfig("topk", args.budget if mode is not None else 1.0)
        r = policy_perplexity(llm, cfg, wins, args.context // 2)
        print(f"{name}: decode ppl {r['ppl']:.2f} over {r['tokens']} tokens "
              f"({r['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
