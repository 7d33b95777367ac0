"""Random workloads on the local engine, each request checked against its run alone.

A seed draws an engine configuration (memory workers, step budget, batch size, prefix
caching, n-gram drafts, scheduling policy, KV split, compute replicas under either
pipeline, session tiers, a fault plan) and 4-13 requests (shared prefixes, chat prompts,
greedy and seeded sampling, n > 1, stop strings and ids, min_tokens, penalties,
logit_bias, bad_words, allowed_token_ids, logprobs, prompt_logprobs, structured output,
per-request KV sparsity, priorities, sessions, streaming), arriving at random steps,
some aborted mid-way, some carrying a token the fault plan fails on. Everything that
ran must leave every KV slot free; each request that completed must answer as it does
alone on a roomy engine of the same configuration (tokens, text, finish reason, error,
logprobs within 1e-3), and one carrying the fault token must fail alone.

What differs by design when a preempted sequence is recomputed (docs/engine.md) is left
out: bf16 / int8 pools and the scoring policies h2o / snapkv are not drawn, and a request
under `streaming` or `topk` is compared only if no readmission after a preemption
computed any of its KV again (a recomputed context attends whole; with the session tiers
a preempted sequence's KV is saved and loaded back instead).

    python -m tests.lamina.random_workload 0 150    # seeds 0..149, one line each
    python -m tests.lamina.random_workload 0 60 --swap-split
    python -m tests.lamina.random_workload 0 60 --scale
    python -m tests.lamina.random_workload 0 60 --grow

`--swap-split` makes each draw's engine swap KV split over workers (`_swap_split`: two
memory workers, `split_kv`, prefix caching and the host and disk tiers, 160 or 220
slots each, 16-63 new tokens a request, no KV sparsity): the seeds above rarely split
a sequence they preempt. A first form of it, with the draws' KV sparsity kept, found
what 10a8af5 fixes (slots of a cached prefix counted as evictable that eviction could
not reach, past a `streaming` request's holes); kept, its sparse requests also differ
from their runs alone, by design.

`--scale` changes the engine's memory workers (1-3) 2-4 times while the requests run
(`_scaled`: pools of 160-600 slots, no KV sparsity), each ask still checked against
its run alone. `--grow` adds to it pools that may grow to 3 workers
(`LLMEngine.allow_growth`, as under an autoscaler), split KV, and pools of a half or a
third of the longest request: a sequence larger than the pools there are waits, and
before each step one short of workers gets them (`Scheduler.short`), as the
autoscaler's next sample would add them.

A draft of this generator found what 419f72e (a sampled draw that rounding changed),
0982a83 (masks of two widths read as one array), 59b45b2 (a culprit search that never
started) and 8163e7d (a sparse prompt's last position fed alone) fix; at 6e510d0, 135
of its first 150 seeds pass, all 150 after.
"""
from __future__ import annotations

import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from traceback import format_exc

from lamina.engine.config import EngineConfig, TierConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.faults import FaultPlan
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams

POISON, LAYER_POISON = 40001, 40002  # tokens no prompt of the workload holds otherwise
TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
        "type changed how knowledge spread across Europe. Scholars wrote letters; "
        "printers set lines of lead. ") * 10
DISK = "<a temporary folder>"  # the disk tier's folder: `check` makes one a workload
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass(frozen=True)
class Ask:
    """One request of a workload."""
    at: int  # the step it arrives before
    prompt: list[int]
    params: SamplingParams
    priority: int
    abort_at: int | None  # the step it is aborted before (None: never)
    session: str | None
    stream: bool


@dataclass(frozen=True)
class Scale:
    """The engine's memory workers changed to `workers` before step `at`."""
    at: int
    workers: int


@dataclass(frozen=True)
class Workload:
    config: dict  # EngineConfig's fields but num_kv_slots and faults (kv_disk_dir: DISK)
    slots: int
    faults: FaultPlan | None
    asks: tuple[Ask, ...]
    scales: tuple[Scale, ...] = ()
    grow: bool = False  # the pools may grow to 3 workers; a short sequence gets them


def engine(lm, split, config: dict, slots: int, faults=None) -> LLMEngine:
    cfg = EngineConfig(num_kv_slots=slots, faults=faults, **config)
    tiers = TierConfig(cfg.kv_host_bytes, cfg.kv_disk_dir, cfg.kv_disk_bytes)
    mems = [MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, slots)),
                       tiers=tiers, worker=w) for w in range(cfg.num_memory_workers)]
    ex = LocalExecutor(split, mems, vocab_size=lm.config.vocab_size, faults=faults,
                       num_compute_workers=cfg.num_compute_workers,
                       pipeline="rotational" if cfg.pipeline == "rotational" else "fixed")
    return LLMEngine(cfg, ex, lm.tokenizer, lm.config)


def _config(r: random.Random) -> dict:
    kw = dict(num_memory_workers=r.choice([1, 2]), max_step_tokens=r.choice([32, 96, 512, 2048]),
              max_batch=r.choice([2, 4, 64]), prefix_caching=r.random() < 0.7,
              speculative_tokens=r.choice([0, 0, 3]),
              scheduling_policy=r.choice(["fcfs", "priority"]), split_kv=r.random() < 0.7)
    if r.random() < 0.25:
        kw.update(num_compute_workers=2, pipeline=r.choice(["fixed", "rotational"]))
    elif r.random() < 0.4 and kw["prefix_caching"]:
        kw.update(kv_host_bytes=r.choice([1 << 20, 64 << 20]),
                  kv_disk_dir=DISK, kv_disk_bytes=64 << 20)
    return kw


def _prompt(r: random.Random, pool: list[int], chat: list[int]) -> list[int]:
    k = r.random()
    if k < 0.2:
        return list(chat)
    if k < 0.5:  # a shared prefix, a varied tail
        return pool[:r.randrange(40, 200)] + [r.randrange(200, 20000)
                                               for _ in range(r.randrange(0, 6))]
    start = r.randrange(0, len(pool) - 10)
    return pool[start:start + r.randrange(1, 250)]


def _params(r: random.Random, pool: list[int]) -> SamplingParams:
    kw: dict = dict(max_tokens=r.randrange(1, 24), temperature=0.0)
    if r.random() < 0.3:
        kw.update(temperature=0.8, seed=r.randrange(1000), top_k=r.choice([-1, 20]),
                  top_p=r.choice([1.0, 0.9]))
    if r.random() < 0.2:
        kw["n"] = r.choice([2, 3])
        if kw["temperature"] == 0:
            kw.update(temperature=0.7, seed=r.randrange(1000))
    extras = [("stop", lambda: (r.choice([" the", ".", ",", "ing"]),), 0.2),
              ("stop_token_ids", lambda: (r.choice(pool[:60]),), 0.15),
              ("min_tokens", lambda: r.randrange(0, kw["max_tokens"] + 1), 0.15),
              ("repetition_penalty", lambda: r.choice([1.3, 0.8]), 0.15),
              ("presence_penalty", lambda: r.choice([1.0, -0.5]), 0.15),
              ("frequency_penalty", lambda: r.choice([0.5, 0.0]), 0.1),
              ("logit_bias", lambda: {r.choice(pool[:80]): r.choice([5.0, -100.0])}, 0.15),
              ("bad_words", lambda: (r.choice(["the", "press", "century"]),), 0.1),
              ("allowed_token_ids", lambda: tuple(sorted(set(pool[:300]))), 0.1),
              ("logprobs", lambda: r.choice([0, 2, 5]), 0.2),
              ("prompt_logprobs", lambda: r.choice([0, 3]), 0.1),
              ("ignore_eos", lambda: True, 0.1),
              ("truncate_prompt_tokens", lambda: r.randrange(1, 50), 0.05)]
    for name, value, p in extras:
        if r.random() < p:
            kw[name] = value()
    if r.random() < 0.1:
        kw["structured_outputs"] = r.choice([{"choice": ["yes", "no", "maybe so"]},
                                             {"regex": "[0-9]{2,4}( apples)?"},
                                             {"json": SCHEMA}])
    if r.random() < 0.1:
        kw.update(kv_sparsity=r.choice(["streaming", "topk"]), kv_budget=r.choice([32, 0.5]))
    return SamplingParams(**kw)


def texts(lm, question: str) -> tuple[list[int], list[int]]:
    """(TEXT's tokens, which prompts are cut from; a chat prompt asking `question`)."""
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
    chat = chat if isinstance(chat, list) else chat["input_ids"]
    return lm.tokenizer(TEXT)["input_ids"], chat


def workload(seed: int, lm, swap_split: bool = False, scale: bool = False,
             grow: bool = False) -> Workload:
    r = random.Random(seed)
    pool, chat = texts(lm, "List three colours and say why you like them.")
    config, slots = _config(r), r.choice([300, 600, 3000])
    faults = None
    if r.random() < 0.3:
        faults = r.choice([FaultPlan(compute_token=POISON),
                           FaultPlan(compute_layer=5, layer_token=LAYER_POISON)])
    asks = []
    for _ in range(r.randrange(4, 14)):
        p = _prompt(r, pool, chat)
        if faults is not None and r.random() < 0.2:
            p = p + [POISON if faults.compute_token else LAYER_POISON]
        asks.append(Ask(r.choice([0, 0, r.randrange(0, 30)]), p, _params(r, pool),
                        r.randrange(-2, 3), r.randrange(1, 40) if r.random() < 0.15 else None,
                        r.choice([None, None, "s1", "s2"]) if config.get("kv_host_bytes")
                        else None, r.random() < 0.3))
    w = Workload(config, slots, faults, tuple(asks))
    w = _swap_split(w, r) if swap_split else w
    return _scaled(w, r, grow) if scale or grow else w


def _scaled(w: Workload, r: random.Random, grow: bool = False) -> Workload:
    """`w` with its memory workers changed 2-4 times while it runs (1-3 of them, in
    steps 1-40), its pools 160-600 slots so that sequences spill and are preempted (but
    each request's whole length fits one: else it ends at the pools' size, unlike its
    run alone), no KV sparsity (a sequence split over workers selects within each
    one's range)."""
    scales = tuple(sorted((Scale(r.randrange(1, 40), r.randrange(1, 4))
                           for _ in range(r.randrange(2, 5))), key=lambda x: x.at))
    asks = tuple(replace(a, params=replace(a.params, kv_sparsity=None, kv_budget=None))
                 for a in w.asks)
    need = max(len(a.prompt) + (a.params.max_tokens or 0) + 1 for a in asks)
    if grow:  # the longest fits 2 or 3 pools only
        return replace(w, config={**w.config, "split_kv": True}, asks=asks, scales=scales,
                       slots=-(-need // r.choice([2, 3])), grow=True)
    return replace(w, slots=max(r.choice([160, 300, 600]), need), asks=asks, scales=scales)


def _swap_split(w: Workload, r: random.Random) -> Workload:
    """`w` on an engine that preempts sequences split over two memory workers and swaps
    them to the tiers, its requests drawing 16-63 tokens, without KV sparsity (over a KV
    split each worker selects within its own range: docs/sparsity.md)."""
    config = {k: v for k, v in w.config.items() if k not in ("num_compute_workers",
                                                              "pipeline")}
    config.update(num_memory_workers=2, split_kv=True, prefix_caching=True,
                  kv_host_bytes=r.choice([1 << 20, 64 << 20]), kv_disk_dir=DISK,
                  kv_disk_bytes=64 << 20)
    asks = tuple(replace(a, params=replace(a.params, max_tokens=r.randrange(16, 64),
                                           kv_sparsity=None, kv_budget=None))
                 for a in w.asks)
    return Workload(config, r.choice([160, 220]), w.faults, asks)


def features(w: Workload) -> set[str]:
    """What a workload holds, in words (for choosing seeds and checking them)."""
    c, out = w.config, set()
    out |= {name for name, on in [
        ("preempts", w.slots < 3000), ("no-cache", not c["prefix_caching"]),
        ("drafts", c["speculative_tokens"] > 0), ("tiers", bool(c.get("kv_host_bytes"))),
        ("chunks", c["max_step_tokens"] <= 96), ("2-memory", c["num_memory_workers"] == 2),
        ("token-fault", w.faults is not None and w.faults.compute_token is not None),
        ("layer-fault", w.faults is not None and w.faults.compute_layer is not None)] if on}
    if c.get("num_compute_workers"):
        out.add(c["pipeline"])
    for a in w.asks:
        p = a.params
        out |= {name for name, on in [
            ("structured", p.structured_outputs is not None),
            ("allowed", p.allowed_token_ids is not None), ("bad-words", bool(p.bad_words)),
            ("min-tokens", p.min_tokens > 0), ("n", p.n > 1), ("sampled", p.temperature > 0),
            ("abort", a.abort_at is not None), ("session", a.session is not None),
            ("stream", a.stream), ("prompt-logprobs", p.prompt_logprobs is not None),
            ("poison", POISON in a.prompt or LAYER_POISON in a.prompt)] if on}
        if p.kv_sparsity:
            out.add(p.kv_sparsity)
    return out


def run(eng: LLMEngine, asks, max_steps: int = 3000, events: dict | None = None,
        every: Callable[[], None] | None = None) -> tuple[dict, set[int]]:
    """The asks arriving and aborted at their steps, `events` ({step: a callable}) run
    before theirs, `every` before each -> ({ask: final output, or the ValueError
    add_request raised}, the asks aborted)."""
    ids: dict[int, int | None] = {}
    outs: dict[int, object] = {}
    aborted: set[int] = set()
    for step in range(max_steps):
        if events and step in events:
            events[step]()
        if every is not None:
            every()
        for k, a in enumerate(asks):
            if a.at == step:
                try:
                    ids[k] = eng.add_request(a.prompt, a.params, priority=a.priority,
                                             session_id=a.session, stream=a.stream)
                except ValueError as e:
                    ids[k], outs[k] = None, e
            if a.abort_at == step and ids.get(k) is not None and k not in outs:
                eng.abort(ids[k])
                aborted.add(k)
        if not eng.has_unfinished() and len(ids) == len(asks):
            return outs, aborted
        by_rid = {rid: k for k, rid in ids.items() if rid is not None}
        for o in eng.step():
            k = by_rid[o.request_id]
            if o.finished and k not in aborted:
                assert k not in outs, f"ask {k} finished twice"
                outs[k] = o
    raise AssertionError(f"{max_steps} steps and requests still unfinished")


def _seen(o) -> list:
    """Its samples' tokens, finish reasons and texts, and its error but the request id
    and step it names."""
    error = o.error and re.sub(r"request \d+ failed in step \d+", "", o.error)
    return [(c.token_ids, c.finish_reason, c.text) for c in o.outputs] + [error]


def _logprobs(o) -> list[float]:
    return [t.logprob for c in o.outputs for t in (c.logprobs or [])]


def check(seed: int, lm, split, swap_split: bool = False, scale: bool = False,
          grow: bool = False) -> list[str]:
    """-> what went wrong in this seed's workload (empty: nothing)."""
    w = workload(seed, lm, swap_split, scale, grow)
    with tempfile.TemporaryDirectory(prefix="lamina-rw-") as disk:
        config = {**w.config, "kv_disk_dir": disk} if w.config.get("kv_disk_dir") \
            else w.config
        return _check(w, config, lm, split)


def _check(w: Workload, config: dict, lm, split) -> list[str]:
    """`check` with the workload's configuration as given (its disk tier's folder real)."""
    eng = engine(lm, split, config, w.slots, w.faults)
    if w.grow:
        eng.allow_growth(3, wait_s=600)
    outs, aborted = run(eng, w.asks, events={x.at: _scale(eng, x.workers) for x in w.scales},
                        every=_grower(eng) if w.grow else None)
    problems = []
    free = [w.slots] * len(eng.allocs)
    if eng.free_slots() != free or any(a.stats().shared for a in eng.allocs):
        problems.append(f"slots free {eng.free_slots()}, were {free}")
    ref = engine(lm, split, {**w.config, "kv_host_bytes": 0, "kv_disk_dir": None,
                             "kv_disk_bytes": 0}, 3000)
    return problems + compare(w.asks, outs, aborted, ref,
                              lambda a: POISON in a.prompt or LAYER_POISON in a.prompt)


def _scale(eng: LLMEngine, n: int) -> Callable[[], None]:
    def event() -> None:
        try:
            done = eng.scale_memory_workers(n)
        except ValueError:  # a request in the engine needs more pools: refused, by design
            return
        SHRUNK[0] += done.relocated
        SHRUNK[1] += done.preempted
    return event


def _grower(eng: LLMEngine) -> Callable[[], None]:
    """Before a step: the workers a waiting sequence is short of, added."""
    def every() -> None:
        if eng.scheduler.short is not None:
            eng.scale_memory_workers(eng.scheduler.short.workers)
            GROWN[0] += 1
    return every


GROWN = [0]  # the pools grown for a short sequence, over the seeds run (`--grow`)
# running sequences a shrink moved with their KV, and those it preempted (`--scale`)
SHRUNK = [0, 0]


def compare(asks, outs: dict, aborted: set[int], ref: LLMEngine, faulty) -> list[str]:
    """Each ask that completed against its run alone on `ref`; those `faulty(ask)` says
    carry a fault must have failed. -> what differs."""
    problems = []
    for k, a in enumerate(asks):
        got = outs.get(k)
        if k in aborted or isinstance(got, ValueError):
            continue
        if got is None:
            problems.append(f"ask {k}: no output")
        elif faulty(a):
            if got.finish_reason != "error":
                problems.append(f"ask {k}: its fault did not fail it: {_seen(got)}")
        elif not (a.params.kv_sparsity and got.metrics["recomputed_tokens"]):
            alone, _ = run(ref, [Ask(0, a.prompt, a.params, a.priority, None, None, False)])
            want = alone[0]
            if isinstance(want, ValueError) or _seen(got) != _seen(want):
                problems.append(f"ask {k} ({a.params}, {len(a.prompt)} prompt tokens): "
                                f"got {_seen(got)}, alone {_seen(want)}")
            elif any(abs(x - y) > 1e-3 for x, y in zip(_logprobs(got), _logprobs(want))):
                problems.append(f"ask {k}: logprobs {_logprobs(got)} alone {_logprobs(want)}")
    return problems


def reference_model():
    """(SmolLM2, its packed split) as the workloads' local engines run them, 2 threads."""
    import torch

    from lamina.model.loader import load
    from lamina.splitter import split_model
    from lamina.splitter.dense import pack_dense

    torch.set_num_threads(2)
    lm = load()
    return lm, pack_dense(split_model(lm.model), "onednn")[0]


def each_seed(lo: int, hi: int, check_one: Callable[[int], tuple[list[str], str]]) -> None:
    """`check_one(seed)` -> (what went wrong, a note) for seeds lo..hi-1: a line each (ok
    or FAIL, its seconds, the note), its problems under it, then the count. A seed that
    raises is reported with its traceback."""
    bad = 0
    for seed in range(lo, hi):
        t = time.perf_counter()
        try:
            problems, note = check_one(seed)
        except Exception as e:  # noqa: BLE001 - a seed that raises is reported, not fatal
            problems, note = [f"raised {type(e).__name__}: {e}\n{format_exc()}"], ""
        bad += bool(problems)
        print(f"seed {seed}: {'FAIL' if problems else 'ok'} "
              f"({time.perf_counter() - t:.1f} s) {note}", flush=True)
        for p in problems:
            print("   ", p[:6000], flush=True)
    print(f"{hi - lo - bad} of {hi - lo} seeds ok")


def main() -> None:
    lm, split = reference_model()
    swap_split, scale = "--swap-split" in sys.argv[3:], "--scale" in sys.argv[3:]
    grow = "--grow" in sys.argv[3:]
    each_seed(int(sys.argv[1]), int(sys.argv[2]),
              lambda seed: (check(seed, lm, split, swap_split, scale, grow), ""))
    if grow:
        print(f"pools grown for a sequence short of workers: {GROWN[0]} times")
    if scale or grow:
        print(f"shrinks: {SHRUNK[0]} running sequences moved with their KV, {SHRUNK[1]} "
              "preempted")


if __name__ == "__main__":
    main()
