"""Ctrl-C during `LLM.generate` (local executor, SmolLM2). The first stops the call once
the step in flight ends; a second cuts that step where it is, and the engine resets
itself (workers, scheduler, prefix cache). Either way the call raises KeyboardInterrupt,
no request of it is left, every KV slot is free or cached, and the next calls give HF's
greedy tokens: a prompt the first Ctrl-C stopped reuses the KV it had written (it was
whole). A cut at any line of the engine's Python (scheduler, allocator, prefix cache,
engine) leaves it as sound. A step's own error, not recovered, leaves `generate` the same
way, and none of the KV that step was writing is cached. Calls from several threads
share the engine (a Ctrl-C stops the main thread's alone); a call beside a request added
to the engine directly is refused; `LLM.shutdown()` stops a call in flight. The Ray
client's `generate` is in tests/cluster/test_ray_service.py."""
import os
import random
import signal
import sys
import threading
import time
from dataclasses import replace

import pytest

from lamina import LLM, SamplingParams
from lamina.compute.compute_side import ComputeSide
from lamina.errors import EngineDead
from tests.conftest import HF_NEW

SLOTS = 4096
CHUNK = 256  # max_step_tokens: the 600-token prompt is fed in 3 steps
GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_slots=SLOTS, max_step_tokens=CHUNK)
    yield llm
    llm.shutdown()


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler in place (what `StepBoundary` replaces), as in a
    script or a notebook's cell; the signal goes to this (the main) thread."""
    assert threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def assert_left_as_before(llm, recoveries: int) -> None:
    eng = llm.engine
    assert eng.request_ids() == set() and not eng.has_unfinished()
    assert eng.num_recoveries == recoveries
    assert eng.free_slots() == [SLOTS]  # free, or held by the prefix cache alone
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


@pytest.mark.parametrize("at_step,written", [(2, 2 * CHUNK), (5, 600 + 2)])
def test_ctrl_c_ends_the_step_in_flight_then_stops_the_call(
        llm, prompts, hf_greedy, python_sigint, monkeypatch, at_step, written):
    """Ctrl-C in step 2 (the prompt's second chunk) or step 5 (its third decode): that
    step runs to its end, no other starts, the call raises; the KV that step wrote is
    whole, so the same prompt next reuses it and gives HF's tokens."""
    eng, calls, ended = llm.engine, [], []
    eng.clear_prefix_cache()
    step, recoveries = eng.step, eng.num_recoveries

    def stepping():
        calls.append(1)
        if len(calls) == at_step:
            ctrl_c()  # handled here, in the main thread: held by StepBoundary
        out = step()
        ended.append(1)
        return out

    monkeypatch.setattr(eng, "step", stepping)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompts[8], prompts[3]], GREEDY, use_tqdm=False)
    assert (len(calls), len(ended)) == (at_step, at_step)
    monkeypatch.undo()
    assert_left_as_before(llm, recoveries)
    out = llm.generate([prompts[8]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy[8]
    assert out.metrics["cached_tokens"] == min(written, len(prompts[8]) - 1)


def test_a_second_ctrl_c_cuts_the_step_and_the_engine_resets_itself(
        llm, prompts, hf_greedy, python_sigint, monkeypatch):
    """Both Ctrl-Cs at layer 15 of the third step: the second raises there, mid-layer;
    the engine resets its workers and drops its prefix cache (nothing the cut step
    half wrote is kept), says so in `recoveries`, and serves as before."""
    eng, submits = llm.engine, []
    recoveries, submit = eng.num_recoveries, ComputeSide._submit
    layers = llm.loaded.config.num_hidden_layers

    def submitting(self, layer, *args):
        submits.append(layer)
        if len(submits) == 2 * layers + 15:
            ctrl_c()  # held
            ctrl_c()  # raises: the step is cut here
        return submit(self, layer, *args)

    monkeypatch.setattr(ComputeSide, "_submit", submitting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompts[8], prompts[5]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert len(submits) == 2 * layers + 15  # it raised where the second one came
    assert_left_as_before(llm, recoveries + 1)
    assert eng.recoveries[-1] == "a step cut part-way (KeyboardInterrupt)"
    assert eng.scheduler.caches[0].size == 0  # all slots free
    outs = llm.generate([prompts[8], prompts[5]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[8], hf_greedy[5]]


def test_a_failed_step_leaves_generate_with_its_requests_and_caches_none_of_its_kv(
        llm, prompts, hf_greedy, python_sigint, monkeypatch):
    """Recovery off, layer 20 of the prompt's first chunk raises: `generate` raises that
    error with its request aborted; the KV of the chunk (layers 0-19 written, the rest
    not) is not cached, so the prompt next is computed whole and gives HF's tokens."""
    eng, submit = llm.engine, ComputeSide._submit
    eng.clear_prefix_cache()
    config, recoveries = eng.config, eng.num_recoveries

    def failing(self, layer, *args):
        if layer == 20:
            raise RuntimeError("a bug in layer 20")
        return submit(self, layer, *args)

    monkeypatch.setattr(ComputeSide, "_submit", failing)
    eng.config = replace(config, max_recoveries=0, find_culprits=False)
    try:
        with pytest.raises(RuntimeError, match="a bug in layer 20"):
            llm.generate([prompts[8]], GREEDY, use_tqdm=False)
    finally:
        eng.config = config
        monkeypatch.undo()
    assert_left_as_before(llm, recoveries)
    assert eng.scheduler.caches[0].size == 0
    out = llm.generate([prompts[8]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy[8] and out.metrics["cached_tokens"] == 0


def generate_in(llm, prompts, got: dict, key, start: threading.Barrier | None = None,
                params: SamplingParams = GREEDY):
    """A thread calling `llm.generate`: its outputs (or its error) in `got[key]`."""
    def call():
        if start is not None:
            start.wait()
        try:
            got[key] = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 (the thread hands its error to the test)
            got[key] = e
    t = threading.Thread(target=call)
    t.start()
    return t


def wait_until(ready, thread: threading.Thread, got: dict, within_s: float = 120) -> None:
    """Until `ready()`, while `thread` (a `generate_in`) runs: a call that ended first
    fails the test with its error, not a wait without end."""
    deadline = time.monotonic() + within_s
    while not ready():
        assert thread.is_alive() and time.monotonic() < deadline, got
        time.sleep(0.001)


def test_calls_from_threads_batch_together_and_each_gets_its_own(llm, prompts, hf_greedy,
                                                                monkeypatch):
    """Three threads call `generate` at once: each call gets its own prompts' HF greedy
    tokens, in its order; some step carried requests of all three (one batch, not three
    in turn); the engine ends holding nothing. Before, two threads stepping the engine
    at once broke a step (`ValueError: seq 2: 0 slots from position 2 ...`)."""
    eng, picks, got, seen = llm.engine, [[1, 9], [3], [0, 4, 10]], {}, []
    step = eng.step

    def stepping():
        seen.append(eng.request_ids())
        return step()

    monkeypatch.setattr(eng, "step", stepping)
    start = threading.Barrier(len(picks))
    for t in [generate_in(llm, [prompts[i] for i in pick], got, k, start)
              for k, pick in enumerate(picks)]:
        t.join(120)
    for k, pick in enumerate(picks):
        assert [o.token_ids for o in got[k]] == [hf_greedy[i] for i in pick], got[k]
    ids = [{o.request_id for o in got[k]} for k in range(len(picks))]
    assert any(all(held & mine for mine in ids) for held in seen)
    assert eng.request_ids() == set() and eng.free_slots() == [SLOTS]


def test_a_failed_step_ends_every_call_it_held(llm, prompts, hf_greedy, monkeypatch):
    """Recovery off, two threads' calls in one batch, a step fails at layer 20: both
    calls raise that error with their requests aborted, whichever thread ran the step
    (the other's requests were in it too: it is the failure a server's loop stops at);
    the next call gives HF's tokens."""
    eng, got, submit = llm.engine, {}, ComputeSide._submit
    config, start = eng.config, eng.scheduler.step
    held = threading.Event()

    def failing(self, layer, *args):
        if layer == 20 and eng.scheduler.step >= start + 6 and held.is_set():
            raise RuntimeError("a bug in layer 20")
        return submit(self, layer, *args)

    def stepping():  # the failing step holds both calls' requests
        if len(eng.request_ids()) == 2:
            held.set()
        return step()

    step = eng.step
    monkeypatch.setattr(ComputeSide, "_submit", failing)
    monkeypatch.setattr(eng, "step", stepping)
    eng.config = replace(config, max_recoveries=0, find_culprits=False)
    try:
        start_both = threading.Barrier(2)
        for t in [generate_in(llm, [prompts[i]], got, i, start_both) for i in (3, 5)]:
            t.join(120)
    finally:
        eng.config = config
        monkeypatch.undo()
    assert [str(got[i]) for i in (3, 5)] == ["a bug in layer 20"] * 2, got
    assert eng.request_ids() == set() and eng.free_slots() == [SLOTS]
    assert llm.generate([prompts[5]], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy[5]


def test_ctrl_c_stops_the_main_threads_call_alone(llm, prompts, hf_greedy, python_sigint,
                                                  monkeypatch):
    """Another thread's call runs while the main thread's is Ctrl-C'd in its third
    step: the main thread's call raises with its request aborted, the other call runs
    on to HF's tokens."""
    eng, got, mine = llm.engine, {}, []
    step, before = eng.step, eng.num_recoveries

    def stepping():
        if threading.current_thread() is threading.main_thread():
            mine.append(1)
            if len(mine) == 3:
                ctrl_c()  # held to this step's end
        return step()

    monkeypatch.setattr(eng, "step", stepping)
    other = generate_in(llm, [prompts[8]], got, "other")
    wait_until(lambda: eng.request_ids(), other, got)  # the other call's request is in
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompts[3]], GREEDY, use_tqdm=False)
    assert len(mine) == 3
    other.join(120)
    assert [o.token_ids for o in got["other"]] == [hf_greedy[8]]
    assert_left_as_before(llm, before)


def test_a_call_beside_a_request_added_directly_is_refused_and_changes_nothing(
        llm, prompts, hf_greedy):
    """`generate` steps every request its engine holds: beside one added to
    `llm.engine` directly (whose output it would take), it refuses to start, naming it;
    nothing is added or run. Before, it ran both and failed on that request's output
    (KeyError)."""
    eng = llm.engine
    rid = eng.add_request(prompts[2], GREEDY)
    with pytest.raises(RuntimeError, match=rf"added to it directly \(ids \[{rid}\]\)"):
        llm.generate([prompts[3]], GREEDY, use_tqdm=False)
    assert eng.request_ids() == {rid}
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert [(o.request_id, o.token_ids) for o in outs] == [(rid, hf_greedy[2])]
    assert llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy[3]


ENGINE_FILES = tuple(os.path.join("lamina", *p) for p in [
    ("engine", "engine.py"), ("engine", "scheduler.py"), ("engine", "prefix_cache.py"),
    ("memory", "allocator.py")])


def cut_at(n: int, llm, work, params) -> bool:
    """`llm.generate(work, params)` cut at the n-th line of the engine's Python;
    -> whether it was cut (False: the call ended first)."""
    sys.settrace(CutAt(n))
    try:
        llm.generate(work, params, use_tqdm=False)
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)


def assert_sound(llm, slots: int, prompts, hf_greedy, where) -> None:
    """After a call cut anywhere: no request left, every slot free once the prefix
    cache is cleared, and a greedy request gives HF's tokens."""
    eng = llm.engine
    assert eng.request_ids() == set() and not eng.has_unfinished(), where
    eng.clear_prefix_cache()
    assert [a.num_free() for a in eng.allocs] == [slots], where
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)[0]
    assert again.token_ids == hf_greedy[0][:4], where


class CutAt:
    """A trace function raising KeyboardInterrupt at the n-th line the engine's Python
    runs (what Python's own handler of a second Ctrl-C does, wherever it lands)."""

    def __init__(self, n: int):
        self.seen, self.n = 0, n

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.endswith(ENGINE_FILES):
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.n:
                sys.settrace(None)
                raise KeyboardInterrupt
        return self


def test_a_cut_at_any_line_of_the_engine_leaves_it_sound(llm, prompts, hf_greedy):
    """Cuts at 12 lines spread over one call (adding, scheduling chunks and forks,
    allocating, caching, applying, aborting): after each, no request is left, every
    slot is free once the cache is cleared, and a request gives HF's tokens."""
    eng, rng = llm.engine, random.Random(0)
    work = [prompts[i] for i in (6, 1, 9)]  # 300, 12 and 9 tokens
    params = [SamplingParams(max_tokens=6, temperature=0),
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3),
              SamplingParams(max_tokens=4, temperature=0)]
    whole = CutAt(0)
    eng.clear_prefix_cache()  # each call starts alike: it runs the same lines
    sys.settrace(whole)  # counts the lines of one whole call
    try:
        llm.generate(work, params, use_tqdm=False)
    finally:
        sys.settrace(None)
    cut = 0
    for n in sorted(rng.sample(range(1, whole.seen), 12)):
        eng.clear_prefix_cache()
        cut += cut_at(n, llm, work, params)
        assert_sound(llm, SLOTS, prompts, hf_greedy, n)
    assert cut == 12


SOAK = os.environ.get("LAMINA_CUT_SOAK")  # "SEED:CALLS": the long run behind RESULTS


@pytest.mark.skipif(not SOAK, reason="a soak run, not CI's: LAMINA_CUT_SOAK=SEED:CALLS "
                                     "(RESULTS ran 1:200)")
def test_cut_soak(prompts, hf_greedy):
    """CALLS calls of 1-5 random prefixes (up to 300 tokens) of the 600-token prompt
    (some with n=2 and sampling) on a small engine (64-token chunks, 512 slots:
    preemptions), each cut at a random line in 1..20000 of the engine's Python, or run
    whole when shorter: after each, as in the test above."""
    seed, calls = map(int, SOAK.split(":"))
    llm = LLM(num_kv_slots=512, max_step_tokens=64)
    eng, rng, cuts = llm.engine, random.Random(seed), 0
    for call in range(calls):
        work = [prompts[8][:rng.randrange(2, 300)] for _ in range(rng.randrange(1, 6))]
        params = [SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 2]),
                                 temperature=rng.choice([0, 1.0]), seed=1) for _ in work]
        cuts += cut_at(rng.randrange(1, 20000), llm, work, params)
        assert_sound(llm, 512, prompts, hf_greedy, call)
    print(f"seed {seed}: {calls} calls, {cuts} cut, engine resets {eng.num_recoveries}")
    llm.shutdown()


def test_shutdown_stops_a_call_in_flight_and_refuses_later_ones(llm, prompts):
    """Last of the module's tests on its LLM (this one shuts it): `LLM.shutdown()` while
    another thread's `generate` runs: that call raises `EngineDead` before its next
    step, its request aborted; a later call raises it at once. Before, the call ran on
    to its end on the shut executor."""
    eng, got = llm.engine, {}
    start = eng.scheduler.step
    other = generate_in(llm, [prompts[8]], got, "other")
    wait_until(lambda: eng.scheduler.step >= start + 4, other, got)  # decoding
    llm.shutdown()
    other.join(60)
    assert isinstance(got["other"], EngineDead) and "LLM.shutdown()" in str(got["other"])
    assert eng.request_ids() == set() and eng.scheduler.step < start + 8
    with pytest.raises(EngineDead, match="make a new LLM"):
        llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    # the engine itself, used directly, refuses too (the local executor keeps no state
    # of its own to refuse with): before, it took the request and stepped on
    with pytest.raises(EngineDead, match="make a new LLM"):
        eng.add_request(prompts[1], GREEDY)
    with pytest.raises(EngineDead, match="make a new LLM"):
        eng.step()
    assert eng.request_ids() == set() and not eng.has_unfinished()
