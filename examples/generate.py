"""Generate with attention offloaded to Ray memory workers.

    python examples/generate.py            # local Ray cluster, 2 memory workers
    RAY_ADDRESS=auto python examples/generate.py   # on a cluster started from ray_config.yaml
"""
from lamina import LLM, SamplingParams


def main():
    llm = LLM(executor="ray", num_memory_workers=2)
    params = SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=0)
    outs = llm.chat([[{"role": "user", "content": q}] for q in
                     ["What is the capital of France?", "Give me a synonym for fast."]], params)
    for o in outs:
        print(o.text.strip(), f"[{len(o.token_ids)} tokens, {o.finish_reason}, "
              f"ttft {o.metrics['ttft_s']:.2f}s]")
    llm.shutdown()


if __name__ == "__main__":
    main()
