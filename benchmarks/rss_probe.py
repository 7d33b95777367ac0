"""RSS of the local engine over many prefill lengths: does the process plateau?

One prompt at a time, 1-400 tokens at seeded random lengths, one token drawn each, RSS
printed every 200 requests. oneDNN keeps per-shape state (torch's ideep LRU cache and
oneDNN's primitive cache); set LRU_CACHE_CAPACITY / ONEDNN_PRIMITIVE_CACHE_CAPACITY in
the environment to compare bounds (lamina sets 128 for both unless set), and
`--dense-backend eager` to run without oneDNN:

    python benchmarks/rss_probe.py --requests 1000
    LRU_CACHE_CAPACITY=1024 ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 \
        python benchmarks/rss_probe.py --requests 1000
"""
import argparse
import random


def rss_mb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--dense-backend", default="auto", choices=["auto", "eager", "onednn"])
    args = ap.parse_args()
    from lamina import LLM, SamplingParams

    llm = LLM(executor="local", max_batch=64, dense_backend=args.dense_backend)
    ids = llm.loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 300)[
        "input_ids"]
    rng, params = random.Random(0), SamplingParams(max_tokens=1, temperature=0)
    print("start", rss_mb(), "MB", flush=True)
    for i in range(args.requests):
        llm.generate([ids[:rng.randint(1, 400)]], params, use_tqdm=False)
        if i % 200 == 199:
            print(i + 1, rss_mb(), "MB", flush=True)


if __name__ == "__main__":
    main()
