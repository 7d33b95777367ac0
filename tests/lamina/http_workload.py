"""Random workloads through the OpenAI HTTP server: concurrent clients, some streaming,
some hanging up mid-answer, some sending a bad field; beside them, conversations over
the Responses API.

A seed draws the engine's configuration (step budget, batch size, prefix caching,
n-gram drafts, memory workers, KV split, compute replicas) and 4-11 requests to
`/v1/completions` and `/v1/chat/completions`, each sent from a thread of its own after
a random delay: greedy or seeded sampling, n, stop strings, penalties, logprobs,
structured output (JSON schema), `min_tokens`, `ignore_eos`; streamed (SSE) or not;
some hang up after a few events (a stream) or at once (a plain request); some carry a
bad value of one field. Some Responses turns run in the background (polled until they
end, streamed ones hung up on too; some last ones cancelled at once: then they must stay
cancelled).

Each answer that completed must equal the same request's answer alone on the same
server after (text, finish reason and logprobs within 1e-3 of each choice; a stream's
deltas joined); each bad one must be answered 400 naming its field; after, no request
is left in the engine, every KV slot is free, and no more requests were aborted than
clients hung up.

    python -m tests.lamina.http_workload 0 100    # seeds 0..99, one line each
"""
from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import time
from dataclasses import dataclass

from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from tests.lamina.random_workload import SCHEMA, TEXT, each_seed, engine, reference_model
from tests.lamina.test_server import _Server

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
QUESTIONS = ("Name a colour.", "What is two plus two?", "Write a haiku about rivers.",
             "List three fruits.", "Say hello in French.")
# one bad value per field: (field, value); the 400 must name the field
BAD = (("temperature", -1), ("max_tokens", 0), ("top_p", 1.5), ("n", 0),
       ("presence_penalty", 3), ("frobnicate", 1), ("logit_bias", {"x": 1}))


@dataclass(frozen=True)
class HttpAsk:
    delay: float  # seconds after the workload starts that it is sent
    path: str  # COMPLETIONS or CHAT
    body: dict  # the JSON body, "stream" included
    cut: int | None  # hang up after this many events (0: at once), None: read it all
    bad: str | None  # the field a 400 must name (a bad value), None: a good request


@dataclass(frozen=True)
class Chain:
    """A Responses conversation from one client: its turns sent one after another, each
    continuing the one before (`previous_response_id`)."""
    delay: float
    turns: tuple[dict, ...]  # each turn's body, "stream" and "store" included
    cut: int | None  # the last turn streamed and hung up after this many events
    cancel: bool = False  # the last turn in the background, cancelled once it is queued


@dataclass(frozen=True)
class HttpWorkload:
    config: dict  # EngineConfig fields
    slots: int
    asks: tuple[HttpAsk, ...]
    chains: tuple[Chain, ...] = ()


def _config(r: random.Random) -> dict:
    kw = dict(max_step_tokens=r.choice([32, 512, 2048]), max_batch=r.choice([2, 8, 64]),
              prefix_caching=r.random() < 0.7, speculative_tokens=r.choice([0, 0, 3]),
              num_memory_workers=r.choice([1, 2]), split_kv=r.random() < 0.7)
    if r.random() < 0.25:
        kw.update(num_compute_workers=2, pipeline=r.choice(["fixed", "rotational"]))
    return kw


def _body(r: random.Random, path: str) -> dict:
    words = TEXT.split()
    if path == COMPLETIONS:
        start = r.randrange(0, len(words) - 5)
        body: dict = {"prompt": " ".join(words[start:start + r.randrange(2, 60)])}
    else:
        body = {"messages": [{"role": "user", "content": r.choice(QUESTIONS)}]}
    body.update(max_tokens=r.randrange(1, 24), temperature=0.0)
    if r.random() < 0.4:
        body.update(temperature=0.8, seed=r.randrange(1000), top_p=r.choice([1.0, 0.9]))
        if r.random() < 0.3:
            body["n"] = 2
    extras = [("stop", lambda: [r.choice([" the", ".", ",", "\n"])], 0.2),
              ("presence_penalty", lambda: r.choice([1.0, -0.5]), 0.15),
              ("frequency_penalty", lambda: 0.5, 0.1),
              ("min_tokens", lambda: r.randrange(0, body["max_tokens"] + 1), 0.15),
              ("ignore_eos", lambda: True, 0.15)]
    for name, value, p in extras:
        if r.random() < p:
            body[name] = value()
    if r.random() < 0.25:
        if path == COMPLETIONS:
            body["logprobs"] = r.choice([0, 2])
        else:
            body.update(logprobs=True, top_logprobs=r.choice([0, 2]))
    if path == CHAT and r.random() < 0.1:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "a", "schema": SCHEMA}}
    return body


def workload(seed: int) -> HttpWorkload:
    r = random.Random(seed)
    config, slots = _config(r), r.choice([600, 3000])
    # the chains from a generator of their own: the seeds drawn before them keep theirs
    return HttpWorkload(config, slots, draw_asks(r), draw_chains(random.Random(f"chains {seed}")))


def draw_chains(r: random.Random) -> tuple[Chain, ...]:
    """0-2 Responses conversations of 1-3 turns, stored but for some last turns."""
    chains = []
    for _ in range(r.choice([0, 1, 1, 2])):
        turns = []
        for _ in range(r.choice([1, 2, 2, 3])):
            body = {"input": r.choice(QUESTIONS), "max_output_tokens": r.randrange(1, 16),
                    "temperature": 0.0, "stream": r.random() < 0.5, "store": True}
            if r.random() < 0.3:
                body.update(temperature=0.8, seed=r.randrange(1000))
            if r.random() < 0.3:
                body["instructions"] = "Answer in a few words."
            turns.append(body)
        turns[-1]["store"] = r.random() < 0.8
        cut = r.randrange(1, 4) if turns[-1]["stream"] and r.random() < 0.2 else None
        chains.append(Chain(r.choice([0.0, r.uniform(0, 1.5)]), tuple(turns), cut))
    # background turns from a generator of their own (the draws above keep theirs)
    b = random.Random(r.random())
    for k, chain in enumerate(chains):
        for body in chain.turns:
            if body["store"] and b.random() < 0.35:
                body["background"] = True  # a stream of it hung up on runs on
        last = chain.turns[-1]
        cancel = last.get("background", False) and not last["stream"] and b.random() < 0.4
        chains[k] = Chain(chain.delay, chain.turns, chain.cut, cancel)
    return tuple(chains)


def draw_asks(r: random.Random) -> tuple[HttpAsk, ...]:
    """4-11 clients' requests, each after a random delay."""
    asks = []
    for _ in range(r.randrange(4, 12)):
        path = r.choice([COMPLETIONS, CHAT])
        body, bad = _body(r, path), None
        body["stream"] = r.random() < 0.5
        if r.random() < 0.15:
            bad, value = r.choice(BAD)
            body[bad] = value
        cut = None
        if bad is None and r.random() < 0.2:
            cut = r.randrange(1, 4) if body["stream"] else 0
        asks.append(HttpAsk(r.choice([0.0, 0.0, r.uniform(0, 1.5)]), path, body, cut, bad))
    return tuple(asks)


def features(w: HttpWorkload) -> set[str]:
    """What a workload holds, in words (for choosing seeds and checking them)."""
    c = w.config
    out = {name for name, on in [
        ("replicas", c.get("num_compute_workers", 1) > 1), ("no-cache", not c["prefix_caching"]),
        ("drafts", c["speculative_tokens"] > 0), ("chunks", c["max_step_tokens"] <= 32),
        ("2-memory", c["num_memory_workers"] == 2)] if on}
    for a in w.asks:
        b = a.body
        out |= {name for name, on in [
            ("chat", a.path == CHAT), ("completions", a.path == COMPLETIONS),
            ("stream", b["stream"] and a.cut is None and a.bad is None),
            ("cut-stream", a.cut is not None and a.cut > 0), ("cut-plain", a.cut == 0),
            ("bad", a.bad is not None), ("n", b.get("n") == 2),
            ("sampled", b["temperature"] > 0), ("logprobs", "logprobs" in b),
            ("json", "response_format" in b), ("stop", "stop" in b)] if on}
    return out | chain_features(w.chains)


def chain_features(chains) -> set[str]:
    """What Responses conversations hold, in words."""
    out: set[str] = set()
    for c in chains:
        out |= {name for name, on in [
            ("responses", True), ("responses-chain", len(c.turns) > 1),
            ("responses-stream", any(t["stream"] for t in c.turns)),
            ("responses-unstored", not c.turns[-1]["store"]),
            ("responses-cut", c.cut is not None),
            ("responses-background", any(t.get("background") for t in c.turns)),
            ("responses-cancel", c.cancel),
            ("responses-background-cut", c.cut is not None and bool(
                c.turns[-1].get("background")))] if on}
    return out


@dataclass
class Answer:
    status: int = 0
    body: dict | None = None  # a plain answer's JSON (or an error's)
    events: list | None = None  # a stream's decoded `data:` events, up to [DONE]
    cut: bool = False  # the client hung up (a background response: it was cancelled)
    queued: dict | None = None  # a background response's first answer
    deltas: str | None = None  # a streamed background one: its events' text


def send(port: int, ask: HttpAsk) -> Answer:
    """POST the ask, read (or hang up on) its answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", ask.path, json.dumps(ask.body),
                     {"Content-Type": "application/json"})
        if ask.cut == 0:
            return Answer(cut=True)  # hangs up before the answer
        resp = conn.getresponse()
        if not ask.body.get("stream") or resp.status != 200:
            return Answer(resp.status, json.loads(resp.read()))
        events: list = []
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if ask.cut is not None and len(events) >= ask.cut:
                return Answer(resp.status, events=events, cut=True)
        return Answer(resp.status, events=events)
    finally:
        conn.close()


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def send_chain(port: int, chain: Chain, prev: str | None = None) -> list[Answer]:
    """The chain's turns, each continuing the one before -> their answers, up to the
    first that failed or was hung up on."""
    out: list[Answer] = []
    for k, body in enumerate(chain.turns):
        last = k == len(chain.turns) - 1
        ask = HttpAsk(0, RESPONSES, {**body, "previous_response_id": prev},
                      chain.cut if last else None, None)
        out.append(send(port, ask))
        if body.get("background") and out[-1].status == 200:
            out[-1] = settle(port, out[-1], chain.cancel and last)
        if out[-1].status != 200 or out[-1].cut:
            break
        prev = response_of(out[-1])["id"]
    return out


def settle(port: int, first: Answer, cancel: bool, within_s: float = 300) -> Answer:
    """A background response (`first`: its answer, or its events up to where the
    client hung up), cancelled at once if `cancel`, polled until it ends -> its last
    Response (`cut`: it was cancelled), with the text its events had (`deltas`)."""
    queued = first.body if first.events is None else first.events[0]["response"]
    deltas = None if first.events is None else "".join(
        e.get("delta", "") for e in first.events
        if e != "[DONE]" and e["type"] == "response.output_text.delta")
    path = f"{RESPONSES}/{queued['id']}"
    if cancel:
        send(port, HttpAsk(0, f"{path}/cancel", {}, None, None))
    deadline = time.monotonic() + within_s
    while (got := get(port, path))[0] == 200 and got[1]["status"] in ("queued",
                                                                       "in_progress"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    status, body = got
    return Answer(status, body, cut=body.get("status") == "cancelled", queued=queued,
                  deltas=deltas)


def response_of(a: Answer) -> dict:
    """A Responses answer's Response: the body, or the stream's last event's."""
    return a.body if a.events is None else a.events[-1]["response"]


def text_of(response: dict) -> str:
    return "".join(p["text"] for it in response["output"] if it["type"] == "message"
                   for p in it["content"])


def start_chains(port: int, chains, timeout: float = 300):
    """Each chain from a thread of its own after its delay -> a function that waits for
    them: ({chain's index: its answers}, the chains with no end within `timeout`)."""
    return start_each(chains, lambda c: send_chain(port, c), "chain {}: no end", timeout)


def chain_cuts(chained: dict[int, list[Answer]]) -> int:
    return sum(a.cut for got in chained.values() for a in got)


def check_chains(port: int, chains, chained: dict[int, list[Answer]]) -> list[str]:
    return [p for c, got in sorted(chained.items())
            for p in check_chain(port, c, chains[c], got)]


def check_chain(port: int, c: int, chain: Chain, got: list[Answer]) -> list[str]:
    """Each turn answered whole: its text and status those of the same turn sent alone
    now (continuing the same stored turn before it), a stream's deltas its text, and
    what `GET` returns the Response itself (a 404 where it was not stored)."""
    prev = None
    for k, (body, a) in enumerate(zip(chain.turns, got)):
        where = f"chain {c} turn {k}"
        if a.queued is not None and (a.queued["status"], a.queued["output"]) != ("queued", []):
            return [f"{where}: in the background, first answered {a.queued}"]
        if a.cut and a.queued is not None:  # cancelled: it stays so
            status, stored = get(port, f"{RESPONSES}/{a.queued['id']}")
            return [] if (status, stored.get("status")) == (200, "cancelled") else [
                f"{where}: cancelled, then GET {status}: {stored}"]
        if a.cut:
            return []
        if a.status != 200:
            return [f"{where}: status {a.status}: {a.body}"]
        resp = response_of(a)
        if a.queued is not None and resp["status"] not in ("completed", "incomplete"):
            return [f"{where}: in the background, it ended {resp}"]
        if a.deltas is not None and not text_of(resp).startswith(a.deltas):
            return [f"{where}: in the background, streamed {a.deltas!r}, then "
                    f"{text_of(resp)!r}"]
        if a.events is not None:
            deltas = "".join(e.get("delta", "") for e in a.events
                             if e["type"] == "response.output_text.delta")
            if deltas != text_of(resp) or resp["status"] not in ("completed", "incomplete"):
                return [f"{where}: stream {resp['status']}, deltas {deltas!r}, text "
                        f"{text_of(resp)!r}"]
        alone = send(port, HttpAsk(0, RESPONSES, {**body, "stream": False, "store": False,
                                                  "background": False,
                                                  "previous_response_id": prev}, None, None))
        if alone.status != 200 or (text_of(resp), resp["status"]) != (
                text_of(alone.body), alone.body["status"]):
            return [f"{where} ({body}): {text_of(resp)!r} {resp['status']}, alone "
                    f"{alone.status} {alone.body if alone.status != 200 else text_of(alone.body)}"]
        status, stored = get(port, f"{RESPONSES}/{resp['id']}")
        if (status, stored if status == 200 else None) != (
                (200, resp) if body["store"] else (404, None)):
            return [f"{where}: GET {status} (store {body['store']}): {stored}"]
        prev = resp["id"]
    return []


def choices(path: str, a: Answer) -> dict[int, tuple[str, str | None, list[float]]]:
    """{choice index: (its text, finish reason, its tokens' logprobs)} of a plain answer
    or a whole stream."""
    out: dict[int, list] = {}
    for part in ([a.body] if a.events is None else [e for e in a.events if e != "[DONE]"]):
        for c in part.get("choices", []):
            got = out.setdefault(c["index"], ["", None, []])
            if path == COMPLETIONS:
                got[0] += c.get("text") or ""
                got[2] += (c.get("logprobs") or {}).get("token_logprobs") or []
            else:
                got[0] += (c.get("message") or c.get("delta") or {}).get("content") or ""
                got[2] += [x["logprob"] for x in (c.get("logprobs") or {}).get("content") or []]
            got[1] = c.get("finish_reason") or got[1]
    return {i: (t, f, lp) for i, (t, f, lp) in sorted(out.items())}


def _compare(k: int, ask: HttpAsk, got: Answer, alone: Answer) -> list[str]:
    if got.status != 200 or alone.status != 200:
        return [f"ask {k}: status {got.status}, alone {alone.status}: {got.body or alone.body}"]
    if got.events is not None and got.events[-1] != "[DONE]":
        return [f"ask {k}: a stream that did not end with [DONE]: {got.events[-2:]}"]
    mine, want = choices(ask.path, got), choices(ask.path, alone)
    if [(t, f) for t, f, _ in mine.values()] != [(t, f) for t, f, _ in want.values()]:
        return [f"ask {k} ({ask.path}, {ask.body}): got {mine}, alone {want}"]
    for (_, _, x), (_, _, y) in zip(mine.values(), want.values()):
        if len(x) != len(y) or any(abs(a - b) > 1e-3 for a, b in zip(x, y)):
            return [f"ask {k}: logprobs {x}, alone {y}"]
    return []


def check(seed: int, lm, split) -> list[str]:
    """This seed's workload on a new server; -> what went wrong (empty: nothing)."""
    w = workload(seed)
    loop = EngineLoop(engine(lm, split, w.config, w.slots), EngineMetrics())
    srv = _Server(loop, lm.tokenizer)
    try:
        return _run(w, srv, loop)
    finally:
        srv.stop()
        loop.shutdown()


def _run(w: HttpWorkload, srv, loop) -> list[str]:
    eng = loop.engine
    free0 = eng.free_slots()
    talks = start_chains(srv.port, w.chains)
    answers, problems = send_all(srv.port, w.asks)
    chained, late = talks()
    problems += late
    if not _settled(loop, 60):
        problems.append("requests still in the engine 60 s after the last answer")
    cuts = sum(a.cut for a in answers.values()) + chain_cuts(chained)
    if loop.stats["aborted"] > cuts:
        problems.append(f"{loop.stats['aborted']} requests aborted, {cuts} clients hung up")
    problems += check_answers(srv.port, w.asks, answers)
    problems += check_chains(srv.port, w.chains, chained)
    if eng.free_slots() != free0 or any(a.stats().shared for a in eng.allocs):
        problems.append(f"slots free {eng.free_slots()}, were {free0}")
    return problems


def send_all(port: int, asks, timeout: float = 300) -> tuple[dict[int, Answer], list[str]]:
    """Each ask from a thread of its own after its delay -> ({ask's index: its answer},
    the asks with no answer within `timeout`)."""
    return start_each(asks, lambda a: send(port, a), "ask {}: no answer", timeout)()


def start_each(items, send_one, late: str, timeout: float):
    """`send_one(item)` for each item (each with a `delay`), from a thread of its own
    after its delay -> a function that waits for them: ({item's index: what it
    returned}, `late` of those not done within `timeout`)."""
    got: dict[int, object] = {}

    def run(k: int, item) -> None:
        time.sleep(item.delay)
        got[k] = send_one(item)

    threads = [threading.Thread(target=run, args=(k, it), daemon=True)
               for k, it in enumerate(items)]
    for t in threads:
        t.start()

    def wait() -> tuple[dict, list[str]]:
        for t in threads:
            t.join(timeout)
        return got, [f"{late.format(k)} in {timeout:g} s" for k in range(len(items))
                     if k not in got]
    return wait


def check_answers(port: int, asks, answers: dict[int, Answer], skip=frozenset()) -> list[str]:
    """Each bad ask answered 400 naming its field; each other one that was read to its
    end (and not in `skip`) equal to the same request sent alone now."""
    problems = []
    for k, ask in enumerate(asks):
        got = answers.get(k)
        if got is None or got.cut or k in skip:
            continue
        if ask.bad is not None:
            param = (got.body or {}).get("error", {}).get("param")
            if got.status != 400 or param != ask.bad:
                problems.append(f"ask {k}: bad {ask.bad}: {got.status} {got.body}")
            continue
        alone = send(port, HttpAsk(0, ask.path, {**ask.body, "stream": False}, None, None))
        problems += _compare(k, ask, got, alone)
    return problems


def _settled(loop, timeout: float) -> bool:
    """Wait until the loop has held nothing for a second: a request whose client hung
    up may still be on its way in (the server reads it, then finds the client gone and
    aborts it). -> False if it did not within `timeout`."""
    return calm(lambda: loop.engine.has_unfinished() or loop.waiting(), timeout)


def calm(busy, timeout: float) -> bool:
    """Wait until `busy()` has been false for a second -> False if it was not within
    `timeout`."""
    deadline, since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if busy():
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return True
        time.sleep(0.05)
    return False


def main() -> None:
    lm, split = reference_model()
    each_seed(int(sys.argv[1]), int(sys.argv[2]), lambda seed: (
        check(seed, lm, split), str(sorted(features(workload(seed))))))


if __name__ == "__main__":
    main()
