"""A Ray job that generates through the cluster's running Lamina service (`lamina up`).

    ray job submit --working-dir . -- python examples/submit_job.py --out answers.jsonl
    python examples/submit_job.py --prompts prompts.txt --out answers.jsonl   # on a node

Reads prompts (one per line; a few built-in ones without --prompts), submits them all to
the service (they batch with every other job's requests there), streams the first one
to stdout as it is generated, and writes one JSON line per prompt: the prompt, the text
and the token ids. Many such jobs share one deployment; none starts workers of its own.
"""
from __future__ import annotations

import argparse
import json

import lamina
from lamina import SamplingParams

PROMPTS = ["The capital of France is", "Three uses of a paperclip:",
           "Once upon a time, in a quiet village,"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None, help="a file with one prompt per line")
    ap.add_argument("--out", required=True, help="where to write the answers (JSONL)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--service", default="lamina")
    args = ap.parse_args(argv)
    prompts = PROMPTS
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    client = lamina.connect(service=args.service)  # the job's cluster ($RAY_ADDRESS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    handles = [client.submit(p, params) for p in prompts]
    shown = ""
    for out in handles[0]:  # the first answer, streamed as it grows
        print(out.outputs[0].text[len(shown):], end="", flush=True)
        shown = out.outputs[0].text
    print()
    with open(args.out, "w") as f:
        for p, h in zip(prompts, handles):
            o = h.result()
            f.write(json.dumps({"prompt": p, "text": o.outputs[0].text,
                                "token_ids": o.outputs[0].token_ids}) + "\n")
    print(f"{len(prompts)} answers written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
