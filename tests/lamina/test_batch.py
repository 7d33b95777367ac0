"""`lamina batch`: OpenAI batch files through the server app in process. Answers equal
`LLM.generate`; a bad line fails alone (its 400); a malformed file is refused naming the
line; a killed run rerun completes only the missing lines; a 429 is sent again, a line
no server could answer is left for a rerun, not written."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest

from lamina import LLM, SamplingParams
from lamina.entrypoints.api_server import build_app
from lamina.entrypoints.batch import BatchRetry, done_ids, read_input, run_batch
from lamina.entrypoints.engine_loop import EngineLoop


def line(cid, body, url="/v1/completions", **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body,
                       **extra})


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_slots=4096)
    yield llm
    llm.shutdown()


def greedy(llm, prompt, n, **kw) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, **kw),
                        use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("text, where", [
    ("not json", ":2: not JSON"),
    (line("a", {"prompt": "x"}), ":2: duplicate custom_id 'a'"),
    (line("b", {"prompt": "x"}, url="/v1/embeddings"), ":2: url must be one of"),
    (line("c", {"prompt": "x"}, method="GET"), ":2: method must be POST"),
    (json.dumps({"url": "/v1/completions", "body": {}}), ":2: custom_id must be"),
    (line("d", "prompt"), ":2: body must be a JSON object"),
])
def test_a_malformed_file_is_refused_naming_the_line(tmp_path, text, where):
    src = tmp_path / "in.jsonl"
    src.write_text(line("a", {"prompt": "x"}) + "\n" + text + "\n")
    with pytest.raises(ValueError, match=where.replace("(", r"\(")):
        read_input(src)


def test_a_line_cut_off_by_a_kill_is_dropped(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "a"}) + "\n" + '{"custom_id": "b", "resp')
    assert done_ids(out) == {"a"}
    assert out.read_text() == json.dumps({"custom_id": "a"}) + "\n"


def test_answers_equal_generate_and_a_bad_line_fails_alone(llm, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = [{"role": "user", "content": "Name a colour."}]
    src.write_text("\n".join([
        line("plain", {"prompt": "The capital of France is", "max_tokens": 12,
                       "temperature": 0}),
        line("bad", {"prompt": "hello", "max_tokens": -1}),
        line("stream", {"prompt": "hello", "stream": True}),
        line("chat", {"messages": chat, "max_tokens": 10, "temperature": 0},
             url="/v1/chat/completions"),
        line("not text", {"prompt": "hi \ud800", "max_tokens": 2}),  # a lone surrogate
        line("nan", {"prompt": "hi", "max_tokens": 2, "temperature": math.nan}),
    ]) + "\n")
    loop = EngineLoop(llm.engine)
    try:
        r = run_batch(build_app(loop, "m", llm.loaded.tokenizer), src, out, progress=False)
    finally:
        loop.shutdown()
    assert (r.total, r.skipped, r.done, r.failed) == (6, 0, 6, 4)
    rows = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert rows["plain"]["response"]["status_code"] == 200
    assert rows["plain"]["response"]["body"]["choices"][0]["token_ids"] == greedy(
        llm, "The capital of France is", 12)
    assert rows["bad"]["response"]["status_code"] == 400
    assert rows["bad"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert rows["stream"]["response"]["body"]["error"]["param"] == "stream"
    err = rows["not text"]["response"]["body"]["error"]
    assert rows["not text"]["response"]["status_code"] == 400 and err["param"] == "prompt"
    assert "prompt: not valid Unicode: a lone surrogate U+D800 at character 3" in \
        err["message"]
    # NaN, which Python's JSON reads from the file (httpx's own encoder refused to send
    # it, and the batch stopped): the server's 400 naming the field
    err = rows["nan"]["response"]["body"]["error"]
    assert rows["nan"]["response"]["status_code"] == 400 and err["param"] == "temperature"
    prompt = llm.loaded.tokenizer.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=True)
    assert rows["chat"]["response"]["body"]["choices"][0]["token_ids"] == greedy(
        llm, prompt, 10)
    assert all(x["id"].startswith("batch_req_") and x["error"] is None for x in rows.values())


def test_a_killed_run_rerun_completes_only_the_missing_lines(llm, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 12
    prompts = [f"Note {i}: the number {i * 7} is" for i in range(n)]
    src.write_text("\n".join(line(f"r{i}", {"prompt": p, "max_tokens": 4 + 2 * i,
                                            "temperature": 0, "ignore_eos": True})
                             for i, p in enumerate(prompts)) + "\n")
    cmd = [sys.executable, "-m", "lamina.entrypoints.cli", "batch", "--local",
           "--no-progress", str(src), str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_text().count("\n") >= 3):
        assert first.poll() is None, first.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    kept = done_ids(out)
    assert 3 <= len(kept) < n  # killed mid-run
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{n - len(kept)} answered now (0 with an error status, 0 sent again after a " \
           f"429 / 503), {len(kept)} already " \
           f"there, {n} in" in rerun.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in rows) == sorted(f"r{i}" for i in range(n))
    want = llm.generate(prompts, [SamplingParams(max_tokens=4 + 2 * i, temperature=0,
                                                 ignore_eos=True) for i in range(n)],
                        use_tqdm=False)  # one batch: the references in one run
    for x in rows:
        i = int(x["custom_id"][1:])
        assert x["response"]["body"]["choices"][0]["token_ids"] == want[i].token_ids


def numbered(tmp_path, n: int, new: int) -> tuple[list[str], object, object]:
    """An INPUT of n completions (greedy, `new` tokens each) -> (prompts, INPUT, OUTPUT)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [f"Item {i}: the colour of the sky is" for i in range(n)]
    src.write_text("\n".join(line(f"r{i}", {"prompt": p, "max_tokens": new, "temperature": 0,
                                            "ignore_eos": True})
                             for i, p in enumerate(prompts)) + "\n")
    return prompts, src, out


def tokens_by_id(out) -> dict[str, list[int]]:
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(x["response"]["status_code"] == 200 for x in rows), rows
    return {x["custom_id"]: x["response"]["body"]["choices"][0]["token_ids"] for x in rows}


def test_lines_a_full_queue_refused_are_sent_again(tmp_path):
    """A server whose queue is full (other jobs share it) answers 429: no answer, so the
    line is sent again after the Retry-After, and every line ends 200 with the tokens
    `LLM.generate` gives (429s were written as the lines' results, for good)."""
    one = LLM(num_kv_slots=1024, max_batch=1)  # one request runs, one waits, the rest: 429
    loop = EngineLoop(one.engine, max_waiting=1)
    try:
        prompts, src, out = numbered(tmp_path, 5, 6)
        r = run_batch(build_app(loop, "m", one.loaded.tokenizer), src, out, progress=False)
        want = {f"r{i}": greedy(one, p, 6, ignore_eos=True) for i, p in enumerate(prompts)}
        assert tokens_by_id(out) == want
        assert loop.stats["rejected"] > 0 and (r.done, r.failed, r.left) == (5, 0, 0)
        assert 3 <= r.retried <= 4  # at most one ran and one waited: the rest refused
    finally:
        loop.shutdown()
        one.shutdown()


def test_lines_a_stopped_engine_cannot_answer_are_left_for_a_rerun(llm, tmp_path):
    """A stopped engine answers 503: not a result. Its lines are left out of OUTPUT
    (`left`, with the reason), so a rerun on an engine that runs answers every one (a
    503 line was written and skipped by every rerun)."""
    prompts, src, out = numbered(tmp_path, 3, 4)
    dead = EngineLoop(llm.engine)
    dead.shutdown()
    r = run_batch(build_app(dead, "m", llm.loaded.tokenizer), src, out, progress=False,
                  retry=BatchRetry(unavailable=False))
    assert not out.exists() or out.read_text() == ""
    assert (r.done, r.left) == (0, 3) and r.why_left.startswith("503: ")
    loop = EngineLoop(llm.engine)
    try:
        r = run_batch(build_app(loop, "m", llm.loaded.tokenizer), src, out, progress=False)
    finally:
        loop.shutdown()
    assert (r.skipped, r.done, r.left) == (0, 3, 0)
    assert tokens_by_id(out) == {f"r{i}": greedy(llm, p, 4, ignore_eos=True)
                                 for i, p in enumerate(prompts)}
