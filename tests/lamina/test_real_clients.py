"""Real clients against `lamina serve`'s app (local executor, SmolLM2, fp32), each run as
its own process the way a user runs it:

- guidellm (`guidellm run`): its default request shape (chat, streamed, content parts,
  `max_completion_tokens`, `continuous_usage_stats`, `ignore_eos`); every request must
  succeed with exactly the tokens it asked for, and guidellm's own count of the prompt
  tokens must equal the server's usage. Its completions shape drives
  `lamina bench serve`, run here with --quick.
- lm-eval (`lm_eval --model local-completions`) on a task from local files: its
  loglikelihoods (echo + logprobs over token ids) must equal HF's on the same tokens,
  and its greedy generations (stop at a newline) HF greedy's.

Both clients read the tokenizer from a folder the test writes; nothing downloads.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from lamina.bench.serve import OFFLINE, guidellm, server_counts, summarize
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from tests.lamina.test_engine import engine as _engine
from tests.lamina.test_server import _Server

pytest.importorskip("guidellm", reason="guidellm is in the dev extras (make setup)")
pytest.importorskip("lm_eval", reason="lm-eval[api] is in the dev extras (make setup)")

CLIENT_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def served(smol, smol_packed, tmp_path_factory):
    """The server, and a folder holding the model's tokenizer for the clients."""
    tok_dir = tmp_path_factory.mktemp("tokenizer")
    smol.tokenizer.save_pretrained(tok_dir)
    loop = EngineLoop(_engine(smol, smol_packed), EngineMetrics())
    srv = _Server(loop, smol.tokenizer)
    yield srv, str(tok_dir)
    srv.stop()
    loop.shutdown()


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    """A client's command line, offline; a failure shows its output."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=CLIENT_TIMEOUT_S, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_guidellm_benchmark_runs_clean(served, tmp_path):
    """guidellm's default shape, chat; its completions shape runs in
    `test_bench_serve_quick`."""
    srv, tok_dir = served
    before = server_counts(srv.url)
    bench = guidellm(srv.url, tok_dir, 4, 8, 48, 12, tmp_path / "guidellm.json",
                     route="/v1/chat/completions")
    after, requests, row = server_counts(srv.url), bench["requests"], summarize(bench)
    errors = [r["info"]["error"] for r in requests["errored"] + requests["incomplete"]]
    assert not errors, errors[:2]
    # the server's own count: every request the run made finished, none failed
    assert (after["ok"] - before["ok"], after["failed"] - before["failed"]) == (8, 0)
    # guidellm's record can miss the last request (`summarize`'s docstring), never add one
    assert row["client_failed"] == 0 and len(requests["successful"]) <= row["client_ok"] <= 8
    # the requests guidellm measured (it leaves out one ending after the stop time it
    # computes, as `lamina.bench.serve.summarize` says): each checked whole
    done = requests["successful"]
    assert 1 <= len(done) <= 8
    for r in done:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
        assert r["output_tokens"] == 12  # ignore_eos: exactly what it asked for
        # guidellm's own count of what it sent equals the server's usage
        assert r["input_metrics"]["text_tokens"] == r["prompt_tokens"]
        assert r["time_to_first_token_ms"] > 0 and r["inter_token_latency_ms"] > 0
        assert body["max_completion_tokens"] == 12
        assert isinstance(body["messages"][0]["content"], list)  # content parts


MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"],
     "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "Newton"],
     "answer": 0},
    {"question": "The opposite of hot is", "choices": ["warm", "cold", "blue"], "answer": 1},
    {"question": "Two plus two equals", "choices": ["three", "five", "four"], "answer": 2},
]
TASKS = {
    "lamina_mc": ("output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                  "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
                  "metric_list:\n  - metric: acc\n"),
    "lamina_gen": ("output_type: generate_until\ndoc_to_text: \"Q: {{question}}?\\nA:\"\n"
                   "doc_to_target: \"{{choices[answer]}}\"\n"
                   "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 10\n"
                   "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
                   "    aggregation: mean\n    higher_is_better: true\n"),
}


def _samples(out_dir, task: str) -> list[dict]:
    [path] = list(out_dir.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def _hf_loglikelihood(smol, context: str, continuation: str) -> tuple[float, bool]:
    """HF's log P(continuation | context) and whether it is the greedy continuation,
    split into tokens as lm-eval splits them (encode the whole, cut at the context)."""
    tok = smol.tokenizer
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logp = torch.log_softmax(smol.model(torch.tensor([whole])).logits[0].double(), -1)
    picked = logp[n_ctx - 1:-1]  # row t predicts token t + 1
    cont = torch.tensor(whole[n_ctx:])
    return (float(picked.gather(1, cont[:, None]).sum()),
            bool((picked.argmax(-1) == cont).all()))


def test_lm_eval_loglikelihoods_and_generations_equal_hf(served, smol, tmp_path):
    srv, tok_dir = served
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}")
    out = tmp_path / "out"
    _run(["lm_eval", "--model", "local-completions", "--model_args",
          f"base_url={srv.url}/v1/completions,tokenizer={tok_dir},"
          "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
          "--tasks", ",".join(TASKS), "--include_path", str(tmp_path),
          "--output_path", str(out), "--log_samples"], tmp_path)
    mc = _samples(out, "lamina_mc")
    assert len(mc) == len(MC_DOCS)
    for s in mc:
        for args, resp in zip(s["arguments"].values(), s["resps"]):
            ll, greedy = float(resp[0][0]), resp[0][1] == "True"
            ref_ll, ref_greedy = _hf_loglikelihood(smol, args["arg_0"], args["arg_1"])
            assert abs(ll - ref_ll) < 2e-3, (args, ll, ref_ll)
            assert greedy == ref_greedy, args
    gen = _samples(out, "lamina_gen")
    assert len(gen) == len(MC_DOCS)
    tok = smol.tokenizer
    for s in gen:
        context = s["arguments"]["gen_args_0"]["arg_0"]
        ids = torch.tensor([tok(context, add_special_tokens=False).input_ids])
        with torch.no_grad():
            ref = smol.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      do_sample=False, max_new_tokens=10,
                                      pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        want = tok.decode(ref, skip_special_tokens=True).split("\n")[0]
        assert s["resps"][0][0] == want, (context, s["resps"], want)


def test_bench_serve_quick(tmp_path):
    """`lamina bench serve --quick`: `lamina serve` in its own process, warmed up, then
    guidellm at 2 streams; its JSON and Markdown say what ran (fp32: the model
    conversion the other tests cached)."""
    from lamina.entrypoints.cli import main

    assert main(["bench", "serve", "--quick", "--dtype", "float32", "--out",
                 str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    [row] = result["rows"]
    # ok / failed: the server's count of the level's requests (its /metrics)
    assert (row["server"], row["concurrency"], row["ok"], row["failed"]) == \
        ("lamina local", 2, 4, 0)
    assert row["client_failed"] == 0 and row["measured"] <= row["client_ok"] <= 4
    # guidellm measures the requests that ended before the stop time it computes (on a
    # busy machine the last one may end after it): those each got their 8 tokens
    assert 1 <= row["measured"] <= 4 and row["output_tokens"] == [8] * row["measured"]
    assert row["tok_s"] > 0
    # the wall clock's split: the server's start, its warm-up, guidellm's whole process
    assert min(row["start_s"], row["warmup_s"]) > 0 and row["client_s"] > 0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"] and row["itl_p50_ms"] > 0
    assert "| lamina local | 2 | 4 / 0 |" in (tmp_path / "serve.md").read_text()
