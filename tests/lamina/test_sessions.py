"""Sessions over the KV tiers: the session index's exact orders, the memory side's store
(bytes back as saved, files checked), and the engine's multi-turn output with tiers equal
to tiers off and to HF greedy, with no slot leaked; each disk-tier fault (truncated,
corrupted, deleted file, full tier) gives the right answer and a warning; bad input is
refused by name or falls back with a warning."""
from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.engine.sessions import SessionIndex, TierMatch, check_session_id
from lamina.entrypoints.calls import Call, CallRequest, SharedEngine
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.memory.tier_orders import TierConfig, TierMiss, TierOrder
from lamina.memory.tiers import TierStore
from lamina.model.prepare import rotary_frequencies

GREEDY = SamplingParams(max_tokens=8, temperature=0)


# -- the index: plain Python, exact orders --
def test_index_saves_only_new_positions_and_moves_lru_unpinned_sessions_down():
    ix = SessionIndex(TierConfig(host_bytes=10, disk_dir="/unused", disk_bytes=12), 1)
    ix.queued("a")
    ix.saved("a", 0, [1, 2, 3], [7, 8, 9])
    ix.done("a")
    assert ix.take_orders() == (TierOrder("save", 0, 0, 0, (7, 8, 9)),)
    ix.queued("a")
    ix.saved("a", 0, [1, 2, 3, 4, 5], [7, 8, 9, 4, 5])  # the next turn: positions 3, 4
    ix.done("a")
    assert ix.take_orders() == (TierOrder("save", 0, 0, 3, (4, 5)),)
    ix.queued("b")
    ix.saved("b", 1, [1, 6, 6, 6, 6, 6], [0, 1, 2, 3, 4, 5])  # 11 bytes > 10 on host
    assert ix.take_orders() == (TierOrder("save", 1, 1, 0, (0, 1, 2, 3, 4, 5)),
                                TierOrder("demote", 0, 0))  # a: LRU, unpinned
    ix.done("b")
    assert ix.take_orders() == () and ix.host_bytes() == 6 and ix.disk_bytes() == 5
    assert ix.match("a", [1, 2, 3, 9, 9], 4) == TierMatch("a", 0, 3, 3, 0)
    ix.queued("a")  # a's next turn: read back from disk at once, b goes down instead
    assert ix.take_orders() == (TierOrder("prefetch", 0, 0), TierOrder("demote", 1, 1))
    assert (ix.host_bytes(), ix.disk_bytes()) == (5, 11)
    ix.load("a", 42, 1, [10, 11])
    assert ix.take_orders() == (TierOrder("load", 0, 0, 1, (10, 11), 42),)
    ix.queued("c")
    ix.saved("c", 0, [5] * 7, list(range(7)))  # host over: b is on disk; disk over: drop b
    ix.done("c")
    orders = ix.take_orders()
    assert TierOrder("drop", 1, 1) in orders and "b" not in ix.sessions
    assert ix.forget([0]) == ["a"] and ix.take_orders() == (TierOrder("drop", 0, 0),)
    assert ix.match("a", [1, 2], 1) is None


def test_a_replaced_workers_unsent_orders_go_with_its_entries():
    """Orders not sent yet to a worker that was replaced are dropped with its entries: a
    save from slots of a pool that is gone would leave an entry no index names."""
    ix = SessionIndex(TierConfig(host_bytes=100), 1)
    ix.saved("a", 0, [1, 2, 3], [7, 8, 9])
    ix.saved("b", 1, [4, 5], [0, 1])
    ix.lost_worker(0)
    assert ix.take_orders() == (TierOrder("save", 1, 1, 0, (0, 1)),)
    assert list(ix.sessions) == ["b"] and not ix.has_orders()


def test_session_ids_are_checked():
    assert check_session_id("user-42:chat_7@x.y") == "user-42:chat_7@x.y"
    for bad in ("", "a b", "../etc", "x" * 129, 42):
        with pytest.raises(ValueError, match="session_id must be"):
            check_session_id(bad)


# -- the store: bytes and files --
def _store(tmp_path, disk_bytes=1 << 20, dtype="float32"):
    pool = KVPool(KVPoolConfig(2, 16, 2, 4, dtype=dtype))
    torch.manual_seed(0)
    for t in (pool.k, pool.v):  # int8 pools: rows of codes and scale bytes, any bits
        t.copy_(torch.randn(t.shape) if dtype != "int8" else
                torch.randint(-128, 128, t.shape, dtype=torch.int8))
    return TierStore(TierConfig(1 << 20, str(tmp_path), disk_bytes), pool), pool


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_store_loads_back_what_it_saved_through_host_and_disk(tmp_path, dtype):
    """int8 pools too: their rows (one buffer, K then V per slot) move as bytes. A
    load holds the memory worker to the per-layer path until its last layer is copied."""
    store, pool = _store(tmp_path, dtype=dtype)
    want_k, want_v = pool.k[:, [3, 5, 9]].clone(), pool.v[:, [3, 5, 9]].clone()
    store.apply([TierOrder("save", 0, 7, 0, (3, 5)), TierOrder("save", 0, 7, 2, (9,)),
                 TierOrder("demote", 0, 7)])
    store._wait(7)
    assert 7 not in store.host and os.path.exists(store.files[7][0])
    store.apply([TierOrder("prefetch", 0, 7)])
    store.apply([TierOrder("load", 0, 7, 0, (12, 13, 14), seq_id=1)])
    for layer in range(2):
        assert store.loading  # the memory worker serves this step layer by layer
        store.load_layer(layer)
    assert not store.loading  # every layer copied: the next steps need not be
    assert torch.equal(pool.k[:, [12, 13, 14]], want_k)
    assert torch.equal(pool.v[:, [12, 13, 14]], want_v)
    with pytest.raises(TierMiss) as miss:  # beyond what it holds: a miss, named
        store.apply([TierOrder("load", 0, 7, 0, (1, 2, 3, 4), seq_id=5)])
    assert miss.value.seq_ids == (5,) and miss.value.entries == (7,)
    store.close()
    assert not os.listdir(tmp_path)  # its directory goes with it


def test_a_new_store_removes_the_folders_of_dead_processes_of_this_machine(tmp_path):
    """A memory worker killed with sessions on disk leaves its folder; the next store
    opened on that disk removes it, and only such folders: not a live process's, not
    another machine's (a shared disk), not what it did not make."""
    import subprocess
    import sys

    from lamina.memory.tiers import MACHINE

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    other = "0123456789ab" if MACHINE != "0123456789ab" else "ba9876543210"
    names = {"dead": f"lamina-kv-{MACHINE}-{child.pid}-0000abcd",
             "live": f"lamina-kv-{MACHINE}-{os.getppid()}-0000abcd",
             "other machine": f"lamina-kv-{other}-{child.pid}-0000abcd",
             "not ours": f"lamina-kv-{MACHINE}-{child.pid}-notatag",
             "a file": "lamina-kv-bench-notes"}
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / names["a file"]).rmdir()
    (tmp_path / names["a file"]).write_text("x")
    (tmp_path / names["dead"] / "w0").mkdir()
    (tmp_path / names["dead"] / "w0" / "e1.kv").write_bytes(b"kv")
    store, _ = _store(tmp_path)
    left = set(os.listdir(tmp_path))
    assert names["dead"] not in left
    assert {names[k] for k in ("live", "other machine", "not ours", "a file")} < left
    assert os.path.basename(os.path.dirname(store.dir)) in left  # its own
    store.close()


@pytest.mark.parametrize("fault", ["truncate", "corrupt", "delete"])
def test_store_treats_a_bad_file_as_a_miss(tmp_path, caplog, fault):
    store, _ = _store(tmp_path)
    store.apply([TierOrder("save", 0, 1, 0, (0, 1, 2, 3)), TierOrder("demote", 0, 1)])
    store._wait(1)
    _break(store.files[1][0], fault)
    with caplog.at_level(logging.WARNING), pytest.raises(TierMiss):
        store.apply([TierOrder("prefetch", 0, 1),
                     TierOrder("load", 0, 1, 0, (8, 9), seq_id=3)])
    assert "entry 1 is missing" in caplog.text
    if fault != "delete":
        assert "unusable" in caplog.text and 1 not in store.files
    store.close()


def _break(path: str, fault: str) -> None:
    if fault == "delete":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    if fault == "truncate":
        data = data[:len(data) - 100]
    else:
        data[-50] ^= 0xFF  # one flipped byte in the last layer's V
    open(path, "wb").write(bytes(data))


def test_unwritable_disk_dir_falls_back_to_host_with_a_warning(tmp_path, caplog):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    pool = KVPool(KVPoolConfig(2, 16, 2, 4))
    with caplog.at_level(logging.WARNING):
        store = TierStore(TierConfig(1 << 20, str(afile), 1 << 20), pool)
    assert store.dir is None and "not writable" in caplog.text
    store.apply([TierOrder("save", 0, 1, 0, (0, 1)), TierOrder("demote", 0, 1)])
    store._wait(1)
    assert 1 not in store.host and "no disk tier" in caplog.text


# -- the engine: multi-turn sessions --
def _engine(smol, split, slots, workers=1, tiers: TierConfig | None = None, **kw):
    t = tiers or TierConfig()
    cfg = EngineConfig(num_memory_workers=workers, num_kv_slots=slots, max_step_tokens=2048,
                       kv_host_bytes=t.host_bytes, kv_disk_dir=t.disk_dir,
                       kv_disk_bytes=t.disk_bytes, **kw)
    pools = [KVPool(KVPoolConfig.for_specs(split.attention_specs, slots)) for _ in range(workers)]
    ex = LocalExecutor(split, [MemorySide(p, tiers=t, worker=w) for w, p in enumerate(pools)],
                       num_compute_workers=cfg.num_compute_workers,
                       pipeline="rotational" if cfg.pipeline == "rotational" else "fixed")
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config)


def _run(eng, turns):
    """turns: [(prompt ids, params, session id)] queued together -> outputs in order."""
    ids = [eng.add_request(p, sp, session_id=s) for p, sp, s in turns]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i] for i in ids]


SYSTEM = "You are a concise assistant. Answer in one short sentence. "


def _conversation(tok, n_sessions, n_turns, run):
    """Sessions sharing a system prompt; session 1 branches off session 0 after turn 1;
    session 2 draws n = 2 samples on its turn 2. `run` answers a list of turns.
    -> (token ids per turn, session, sample), the last turn's prompts."""
    hist = {s: tok(SYSTEM + f"Tell me about place {s}.")["input_ids"] for s in range(n_sessions)}
    answers = []
    for t in range(n_turns):
        turns = [(hist[s], SamplingParams(max_tokens=8, temperature=0,
                                          n=2 if (s, t) == (2, 1) else 1), f"s{s}")
                 for s in range(n_sessions)]
        outs = run(turns)
        last = [p for p, _, _ in turns]
        answers.append([[c.token_ids for c in o.outputs] for o in outs])
        for s, o in enumerate(outs):
            more = tok(f" And what about its food, part {t}?",
                       add_special_tokens=False)["input_ids"]
            hist[s] = hist[s] + o.outputs[0].token_ids + more
        if t == 0:
            hist[1] = hist[0][:-len(more)] + tok(" And its weather?",
                                                 add_special_tokens=False)["input_ids"]
    # session 3 reaches a context limit of 48 tokens: its client keeps the system prompt
    # and the latest tokens, dropping the oldest turns
    n_sys = len(tok(SYSTEM)["input_ids"])
    cut = hist[3][:n_sys] + hist[3][-(CONTEXT_LIMIT - n_sys):]
    out = run([(cut, SamplingParams(max_tokens=8, temperature=0), "s3")])[0]
    answers.append([[c.token_ids for c in out.outputs]])
    return answers, last + [cut]


CONTEXT_LIMIT = 48


def test_multi_turn_sessions_with_tiers_equal_tiers_off_and_hf(smol, smol_packed, tmp_path):
    """4 sessions x 3 turns over 2 workers of 56 slots: the last turns (up to 63 tokens
    with their answers) are split over both workers, running sequences are preempted,
    sessions go to host, then disk, and come back; n = 2; then one session's history is
    truncated at a small context limit (the default: exact, only the system prompt is
    reused; `truncation_reuse` trades that for speed, see the truncation tests)."""
    workers, slots = 2, 56
    tok = smol.tokenizer
    per_token = KVPoolConfig.for_specs(smol_packed.attention_specs, 1).bytes_per_slot
    tiers = TierConfig(host_bytes=120 * per_token, disk_dir=str(tmp_path),
                       disk_bytes=4000 * per_token)
    on = _engine(smol, smol_packed, slots, workers=workers, tiers=tiers)
    off = _engine(smol, smol_packed, slots, workers=workers, prefix_caching=False)
    seen: list = []
    got, hist = _conversation(tok, 4, 3, lambda turns: seen.extend(_run(on, turns)) or
                              seen[-len(turns):])
    want, _ = _conversation(tok, 4, 3, lambda turns: _run(off, turns))
    assert got == want
    assert sum(o.metrics["preemptions"] for o in seen) > 0
    assert max(len(p) for p in hist) + 8 > slots  # a last turn's KV spans both workers
    assert len(hist[-1]) == CONTEXT_LIMIT and seen[-1].metrics["cached_tokens"] >= 13
    st = on.tier_stats()
    assert st["tier_hit_tokens"] > 0 and st["prefetches"] > 0 and st["demoted"] > 0
    assert st["loaded_bytes"] == st["tier_hit_tokens"] * per_token
    assert st["tier_misses"] == 0
    on.clear_prefix_cache()
    assert [a.num_free() for a in on.allocs] == [slots] * workers
    assert all(a.stats().shared == 0 for a in on.allocs)
    # the last turn of session 0 equals HF greedy over its whole history
    ids = torch.tensor([hist[0]])
    with torch.no_grad():
        ref = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=8)[0, ids.shape[1]:].tolist()
    assert got[2][0][0] == ref[:len(got[2][0][0])]
    ids = torch.tensor([hist[-1]])  # and the truncated turn
    with torch.no_grad():
        ref = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=8)[0, ids.shape[1]:].tolist()
    assert got[3][0][0] == ref[:len(got[3][0][0])]
    on.executor.shutdown()


@pytest.mark.parametrize("fault", ["truncate", "corrupt", "delete", "full"])
def test_disk_tier_faults_recompute_with_a_warning(smol, smol_packed, tmp_path, caplog, fault):
    tok = smol.tokenizer
    per_token = KVPoolConfig.for_specs(smol_packed.attention_specs, 1).bytes_per_slot
    disk = 10 * per_token if fault == "full" else 1000 * per_token
    tiers = TierConfig(host_bytes=per_token, disk_dir=str(tmp_path), disk_bytes=disk)
    eng = _engine(smol, smol_packed, 200, tiers=tiers)
    first = tok(SYSTEM + "Tell me about Lyon.")["input_ids"]
    out1 = _run(eng, [(first, GREEDY, "s")])[0]
    _run(eng, [([1, 2, 3], GREEDY, None)])  # a step carries the save and the demotion
    store = eng.executor.memory[0].tiers
    store._wait(0)  # the demotion's write has run
    if fault != "full":
        _break(store.files[0][0], fault)
    eng.clear_prefix_cache()  # the next turn can only come from the tiers (or compute)
    second = first + out1.outputs[0].token_ids + tok(" Why?", add_special_tokens=False)[
        "input_ids"]
    with caplog.at_level(logging.WARNING):
        out2 = _run(eng, [(second, GREEDY, "s")])[0]
    ref = _engine(smol, smol_packed, 200, prefix_caching=False)
    assert out2.outputs[0].token_ids == _run(ref, [(second, GREEDY, None)])[0].outputs[0].token_ids
    assert out2.metrics["cached_tokens"] == 0 and eng.tier_stats()["tier_hit_tokens"] == 0
    want = {"full": "exceeds the disk tier", "delete": "is missing",
            "truncate": "unusable", "corrupt": "checksum mismatch"}[fault]
    assert want in caplog.text
    eng.executor.shutdown()


def test_bad_session_input_is_refused_or_falls_back(smol, smol_packed, tmp_path, caplog):
    eng = _engine(smol, smol_packed, 200, tiers=TierConfig(1 << 20))
    with pytest.raises(ValueError, match="session_id must be"):
        eng.add_request([1, 2, 3], GREEDY, session_id="no spaces")
    assert not eng.has_unfinished() and not eng.sessions.pins
    afile = tmp_path / "afile"
    afile.write_text("x")
    with caplog.at_level(logging.WARNING):
        eng2 = _engine(smol, smol_packed, 200, tiers=TierConfig(1 << 20, str(afile), 1 << 20))
    assert "not writable" in caplog.text
    out = _run(eng2, [([1, 2, 3, 4], GREEDY, "new-session")])[0]  # unknown: a new session
    assert len(out.outputs[0].token_ids) == 8 and out.error is None

    class NoTiers:
        pass

    with pytest.raises(ValueError, match="need memory workers that keep them"):
        LLMEngine(EngineConfig(kv_host_bytes=1 << 20), NoTiers(), None, smol.config)


def test_tier_loads_bring_back_the_saved_kv_bytes(smol, smol_packed):
    """The pool rows a tier load fills equal, bitwise, the rows the first turn's prefill
    and decode wrote, in every layer."""
    tok = smol.tokenizer
    eng = _engine(smol, smol_packed, 200, tiers=TierConfig(1 << 26))
    per_token = eng.executor.tier_bytes_per_token()
    ids = tok(SYSTEM + "Tell me about Rome.")["input_ids"]
    out = _run(eng, [(ids, GREEDY, "r")])[0]
    pool = eng.executor.memory[0].pool
    hist = ids + out.outputs[0].token_ids
    n = len(hist) - 1
    before = eng.scheduler.caches[0].match(hist, n)
    k0, v0 = pool.k[:, before].clone(), pool.v[:, before].clone()
    _run(eng, [([1, 2, 3], GREEDY, None)])  # a step carries the save
    eng.clear_prefix_cache()
    pool.k.zero_()  # nothing of the first turn is left in the pool
    pool.v.zero_()
    again = _run(eng, [(hist + [13], GREEDY, "r")])[0]
    assert again.metrics["cached_tokens"] == again.metrics["tier_cached_tokens"] == n
    assert eng.tier_stats()["tier_hit_tokens"] == n
    metrics = EngineMetrics()
    metrics.step(eng, 0)
    got = {(x.name, tuple(x.labels.values())): x.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for x in fam.samples}
    assert got["lamina_kv_tier_events_total", ("hit_tokens",)] == n
    assert got["lamina_kv_tier_traffic_bytes_total", ("loaded",)] == n * per_token
    after = eng.scheduler.caches[0].match(hist, n)
    assert len(after) == n
    assert torch.equal(pool.k[:, after], k0) and torch.equal(pool.v[:, after], v0)


# -- preemption: a preempted sequence's KV swapped to the host tier and back --
@pytest.mark.parametrize("mode", ["auto", "recompute"])
@pytest.mark.parametrize("workers,slots", [(1, 250), (2, 125)])
def test_preempted_sequences_swap_to_the_host_tier_and_back(smol, smol_packed, prompts,
                                                            hf_greedy, mode, workers, slots):
    """Six prompts (12-128 tokens, 32 new each) in 250 slots with a host tier, on one
    memory worker or split over two (sequences' KV then spans both as they grow):
    growth preempts sequences and others' growth then evicts their cached KV. "auto"
    (swap: the tier is there) saves each preempted sequence's KV to the tiers, each
    worker's part to that worker's, and loads back what the pools lost: on one worker
    no readmission computes any of it again; over two, a first worker whose pool lost
    the end of its part and has no room for it computes those positions on the next
    worker, then loads the parts after them (`Skip`: the executor's table of the
    sequence grows from before the positions fed). "recompute" computes it all. Both
    give HF's greedy tokens, and leave every slot free and, once a step has carried
    the last drops, no entry in the tiers."""
    pick = [1, 3, 4, 10, 11, 12]
    eng = _engine(smol, smol_packed, slots, workers, tiers=TierConfig(1 << 26),
                  preemption_mode=mode)
    per_token = eng.executor.tier_bytes_per_token()
    loaded, plans = [], []
    load, schedule = eng.sessions.load, eng.scheduler.schedule
    eng.sessions.load = lambda key, *a: (loaded.append(key), load(key, *a))[1]
    eng.scheduler.schedule = lambda: (plans.append(schedule()), plans[-1])[1]
    outs = _run(eng, [(prompts[i], SamplingParams(max_tokens=32, temperature=0), None)
                      for i in pick])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[i] for i in pick]
    assert sum(o.metrics["preemptions"] for o in outs) >= 6
    recomputed = sum(o.metrics["recomputed_tokens"] for o in outs)
    st = eng.tier_stats()
    skips = [w for p in plans for w in p.seqs if 0 < w.slots_from < w.start_pos]
    parts = [key for key in loaded if "@" in key]  # a later worker's part
    if mode == "auto":
        assert st["parked_tokens"] > 100 and st["tier_hit_tokens"] > 0
        assert (recomputed == 0) is (workers == 1) and bool(parts) is bool(skips) is (
            workers == 2)
        assert st["saved_bytes"] == st["parked_tokens"] * per_token
        assert st["loaded_bytes"] == st["tier_hit_tokens"] * per_token
    else:
        assert recomputed > 0 and st["parked_tokens"] == st["saved_bytes"] == 0
        assert loaded == parts == skips == []
    metrics = EngineMetrics()
    for o in outs:
        metrics.request(o)
    metrics.step(eng, 0)
    got = {(x.name, tuple(x.labels.values())): x.value
           for fam in text_string_to_metric_families(metrics.render().decode())
           for x in fam.samples}
    assert got["lamina_preemption_recomputed_tokens_total", ()] == recomputed
    assert got.get(("lamina_kv_tier_events_total", ("parked_tokens",)), 0) == \
        st["parked_tokens"]
    # idle: the parked entries' drops wait for the next plan; `flush` sends them at once
    assert any(m.tiers.host for m in eng.executor.memory) is (mode == "auto")
    assert eng.flush() and not eng.flush()
    assert eng.free_slots() == [slots] * workers and eng.sessions.sessions == {}
    assert all(m.tiers.host == {} for m in eng.executor.memory)


def test_an_idle_engine_sends_its_workers_what_the_last_step_left(smol, smol_packed):
    """A finished turn's save (and the table to drop) rides the next plan: with no next
    request, `LLM.generate` (`SharedEngine`) and the serving loop (`EngineLoop`) send it
    in a step with no rows as the engine goes idle, so the session's KV is in its tier
    at once, not whenever a request comes. The engine's own `flush` sends nothing twice,
    nor while a request is in it."""
    ids = smol.tokenizer(SYSTEM + "Tell me about Rome.")["input_ids"]
    eng = _engine(smol, smol_packed, 200, tiers=TierConfig(1 << 26))
    mem = eng.executor.memory[0]
    shared, call = SharedEngine(eng), Call(1)
    shared.add(call, [CallRequest(ids, GREEDY, "r")])
    shared.run(call, SimpleNamespace(asked=False))
    assert call.results[0].finished and list(mem.tiers.host) == [eng.sessions.sessions["r"].id]
    assert not eng.scheduler.owes_workers() and not eng.flush()
    loop = EngineLoop(eng)
    try:
        assert loop.submit(ids, GREEDY, session_id="s").result(timeout=60).finished
        t = time.monotonic()  # (the loop thread's flush: its plan is out before its save)
        while len(mem.tiers.host) < 2 and time.monotonic() - t < 10:
            time.sleep(0.01)
        assert len(mem.tiers.host) == 2 and not eng.scheduler.owes_workers()
    finally:
        loop.shutdown()
    eng.add_request(ids, GREEDY)
    assert not eng.flush() and eng.has_unfinished()


def test_swap_preemption_needs_the_host_tier():
    with pytest.raises(ValueError, match="preemption_mode='swap' saves .* kv_host_bytes"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineConfig(preemption_mode="spill", kv_host_bytes=1 << 20)
    assert EngineConfig(preemption_mode="swap", kv_host_bytes=1 << 20).preemption_mode == "swap"


# -- truncation: kept turns move to new positions --
def _rope(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """NumPy rotate-half RoPE: x [m, H, D] at positions pos [m]."""
    ang = pos[:, None] * inv[None, :]  # [m, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def test_a_shifted_load_re_rotates_keys_to_their_new_positions(tmp_path):
    inv = np.array([1.0, 0.05])
    pool = KVPool(KVPoolConfig(2, 32, 2, 4))
    raw = np.random.default_rng(0).standard_normal((2, 10, 2, 4))  # pre-rotary keys
    pos = np.arange(10, dtype=np.float64)
    for layer in range(2):
        pool.k[layer, :10] = torch.tensor(_rope(raw[layer], pos, inv), dtype=torch.float32)
    pool.v[:, :10] = torch.randn(2, 10, 2, 4)
    store = TierStore(TierConfig(1 << 20), pool, rope_inv_freq=tuple(inv))
    store.apply([TierOrder("save", 0, 0, 0, tuple(range(10)))])
    # positions 6..9 were kept after dropping 4..5 (the shift 2): they land at 4..7
    store.apply([TierOrder("load", 0, 0, 4, (20, 21, 22, 23), seq_id=1, shift=2)])
    for layer in range(2):
        store.load_layer(layer)
        want = _rope(raw[layer, 6:10], np.arange(4, 8, dtype=np.float64), inv)
        np.testing.assert_allclose(pool.k[layer, 20:24].numpy(), want, atol=1e-5)
    assert torch.equal(pool.v[:, 20:24], pool.v[:, 6:10])
    norope = TierStore(TierConfig(1 << 20), pool)
    norope.apply([TierOrder("save", 0, 0, 0, tuple(range(10)))])
    with pytest.raises(ValueError, match="not rotary"):
        norope.apply([TierOrder("load", 0, 0, 4, (20,), seq_id=1, shift=2)])


def test_index_finds_the_kept_run_after_dropped_turns():
    ix = SessionIndex(TierConfig(1 << 20), 1, truncation=True)
    system, t1, t2, t3 = ([k] * 3 + list(range(100 * k, 100 * k + 17)) for k in (1, 2, 3, 4))
    ix.saved("c", 0, system + t1 + t2, list(range(60)))
    m = ix.match("c", system + t2 + t3, 59)
    assert (m.worker, m.prefix, m.upto, m.shift) == (0, 20, 40, 20)
    short = SessionIndex(TierConfig(1 << 20), 1, truncation=True)  # 15 tokens: chance?
    short.saved("c", 0, system + t1 + t2[:15], list(range(55)))
    m = short.match("c", system + t2[:15] + t3, 40)
    assert (m.prefix, m.upto, m.shift) == (20, 20, 0)
    off = SessionIndex(TierConfig(1 << 20), 1)  # truncation reuse off: the prefix only
    off.saved("c", 0, system + t1 + t2, list(range(60)))
    assert off.match("c", system + t2 + t3, 59).upto == 20


def test_truncated_history_reuses_kept_kv_at_new_positions(smol, smol_packed):
    """Turns dropped from the middle of a conversation: the kept turn's KV comes from the
    tier at shifted positions. Layer 0's keys depend only on token and position, so there
    they equal a fresh prefill's; deeper layers saw the dropped turns (not exact)."""
    tok = smol.tokenizer
    rope = rotary_frequencies(smol.model)
    assert rope is not None and len(rope) == 32  # head_dim 64
    t = TierConfig(1 << 28)
    cfg = EngineConfig(num_kv_slots=400, max_step_tokens=2048, kv_host_bytes=t.host_bytes,
                       truncation_reuse=True)
    pool = KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 400))
    eng = LLMEngine(cfg, LocalExecutor(smol_packed, [MemorySide(pool, tiers=t,
                                                               rope_inv_freq=rope)]),
                    smol.tokenizer, smol.config)
    system = tok(SYSTEM)["input_ids"]
    t1 = tok(" The first question was about the old harbour and its ships.",
             add_special_tokens=False)["input_ids"]
    t2 = tok(" The second question asked which painters lived in the town, and in which "
             "of its streets their studios stood.", add_special_tokens=False)["input_ids"]
    first = _run(eng, [(system + t1 + t2, SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True), "c")])[0]
    kept = t2 + first.outputs[0].token_ids
    _run(eng, [([5, 6, 7], GREEDY, None)])  # a step carries the save
    eng.clear_prefix_cache()
    truncated = system + kept + tok(" Why?", add_special_tokens=False)["input_ids"]
    out = _run(eng, [(truncated, GREEDY, "c")])[0]
    n = len(system) + len(kept) - 1  # the last answer token's KV was never written
    assert out.metrics["cached_tokens"] == out.metrics["tier_cached_tokens"] == n
    same = next(i for i, (a, b) in enumerate(zip(system + t1, truncated)) if a != b)
    assert same == len(system) + 1  # t1 and t2 both begin with " The"
    assert eng.tier_stats()["shifted_tokens"] == n - same  # the rest moved left
    got = pool.k[0, eng.scheduler.caches[0].match(truncated, n)].clone()
    fresh = _engine(smol, smol_packed, 400, prefix_caching=True)
    _run(fresh, [(truncated, GREEDY, None)])
    fpool = fresh.executor.memory[0].pool
    want = fpool.k[0, fresh.scheduler.caches[0].match(truncated, n)]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert out.error is None and out.outputs[0].token_ids  # its answer may differ (above)


def test_truncation_reuse_is_refused_without_rotary_positions():
    from tests.tiny_models import tiny_model

    assert rotary_frequencies(tiny_model("gpt2")) is None  # learned absolute positions

    class NoRotary:
        def tier_bytes_per_token(self):
            return 8

        def tier_rotary(self):
            return False

    with pytest.raises(ValueError, match="not rotary"):
        LLMEngine(EngineConfig(kv_host_bytes=1 << 20, truncation_reuse=True), NoRotary(),
                  None, None)


@pytest.mark.parametrize("loading", [False, True])
def test_a_local_recovery_drops_the_tiers_and_computes_the_next_turn(smol, smol_packed,
                                                                     loading):
    """A step that fails part-way on the local executor is recovered: its memory side
    drops the saved sessions with the engine's index (a new, empty tier store), so the
    next turn is computed, not loaded, and gives the tokens a fresh engine gives. With
    the prefix cache cleared the failed step is the one loading the turn's history from
    the tier: its metrics then say nothing was reused (the load never counted)."""
    tok = smol.tokenizer
    eng = _engine(smol, smol_packed, 200, tiers=TierConfig(1 << 26))
    ids = tok(SYSTEM + "Tell me about Rome.")["input_ids"]
    out = _run(eng, [(ids, GREEDY, "r")])[0]
    assert eng.flush()  # idle: the save goes out now
    if loading:
        eng.clear_prefix_cache()
    mem = eng.executor.memory[0]
    old = mem.tiers
    assert old.host and "r" in eng.sessions.sessions
    real, calls = eng.executor.execute, []

    def once(plan):
        calls.append(plan)
        if len(calls) == 1:
            raise RuntimeError("broke mid-step")
        return real(plan)

    eng.executor.execute = once
    hist = ids + out.outputs[0].token_ids + tok(" And its food?",
                                                add_special_tokens=False)["input_ids"]
    rid = eng.add_request(hist, GREEDY, session_id="r")
    assert eng.step() == [] and "broke mid-step" in eng.recoveries[-1]
    assert mem.tiers is not old and not mem.tiers.host and not eng.sessions.sessions
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [o.op for o in calls[0].tier_orders] == (["load"] if loading else [])
    assert done[rid].metrics["tier_cached_tokens"] == 0
    if loading:
        assert done[rid].metrics["cached_tokens"] == 0
    fresh = _engine(smol, smol_packed, 200)
    want = _run(fresh, [(hist, GREEDY, None)])[0]
    assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids
    eng.executor.shutdown()


@pytest.mark.parametrize("pipeline", ["fixed", "rotational"])
def test_sessions_over_compute_replicas_load_their_saved_kv(smol, smol_packed, pipeline):
    """Two compute replicas (fixed: each its own sequences; rotational: every replica
    runs slices of every micro-batch): a step's tier orders go to the memory sides
    once, before the step is split. 4 sessions x 2 turns over 2 memory sides, the
    prefix cache cleared before every turn, so each second turn loads its history from
    the host tier; the answers equal one compute worker's without tiers. The last
    turns' saves go out with the idle engine's `flush` (a step with no rows, split
    over no replica)."""
    tok = smol.tokenizer
    on = _engine(smol, smol_packed, 400, workers=2, tiers=TierConfig(1 << 26),
                 num_compute_workers=2, pipeline=pipeline)
    off = _engine(smol, smol_packed, 400, workers=2, prefix_caching=False)
    seen: list = []

    def run_on(turns):
        on.clear_prefix_cache()
        seen.extend(_run(on, turns))
        return seen[-len(turns):]

    got, _ = _conversation(tok, 4, 2, run_on)
    want, _ = _conversation(tok, 4, 2, lambda turns: _run(off, turns))
    assert got == want
    # every session's second turn came from the tier (its history but the last answer
    # token, whose KV no step wrote)
    assert all(o.metrics["tier_cached_tokens"] > 0 for o in seen[4:])
    st = on.tier_stats()
    assert st["tier_misses"] == 0 and st["tier_hit_tokens"] == sum(
        o.metrics["tier_cached_tokens"] for o in seen)
    assert on.flush() and not on.scheduler.owes_workers()  # the last turns' saves, at once
    entries = on.sessions.sessions.values()
    assert {e.id: on.executor.memory[e.worker].tiers.host[e.id].n for e in entries} == {
        e.id: len(e.tokens) for e in entries}
    on.clear_prefix_cache()
    assert [a.num_free() for a in on.allocs] == [400, 400]
    on.executor.shutdown()
