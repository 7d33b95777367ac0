"""Random workloads through the OpenAI HTTP server (`tests/lamina/http_workload.py`):
concurrent clients, streamed and plain, some hanging up mid-answer, some sending a bad
field, and conversations over the Responses API. Every answer that completed equals the
same request alone (a conversation's turn: sent alone continuing the same stored turn,
and `GET` returns it as answered; one in the background: polled to the same, or
cancelled and staying so), every bad one is a 400 naming its field, and after, the
engine holds nothing and every KV slot is free.
The seeds were chosen to cover what the generator draws (all pass: `python -m
tests.lamina.http_workload 0 60`, `... 1255 1275` and `... 2020 2030`)."""
import pytest

from tests.lamina.http_workload import check, features, workload

SEEDS = {  # seed: what it holds at least
    1261: {"replicas", "chunks", "cut-plain", "cut-stream", "bad", "stream", "chat",
           "responses-background", "responses-cancel", "responses-chain"},
    29: {"2-memory", "drafts", "cut-plain", "cut-stream", "bad", "n", "logprobs", "stop",
         "responses-cut", "responses-unstored"},
    2027: {"2-memory", "chunks", "cut-plain", "cut-stream", "json", "n", "completions",
           "responses-chain", "responses-stream", "responses-background-cut"},
}


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_http_workload_answers_as_each_request_alone(smol, smol_packed, seed):
    assert SEEDS[seed] <= features(workload(seed))
    assert check(seed, smol, smol_packed) == []
