"""Random workloads on a Ray deployment, with its workers killed and hung mid-run.

The requests are those of the local generator (`tests/lamina/random_workload.py`: every
kind, arriving at random steps, some aborted, some carrying a fault token); a seed here
also draws what happens to the workers: a memory worker or the compute worker killed
(`ray.kill`) or stopped (SIGSTOP: alive and silent, so only a timeout finds it) before a
random step, and requests that make the compute worker refuse them, a memory worker
fail them (its channel closed, its process reset), or a layer raise with no sequence
named (the culprit search). The engine's own choices (step budget, batch size, prefix
caching, n-gram drafts, policy, KV split, the slots it may use, session tiers) vary
per seed over one deployment: each seed runs a fresh `LLMEngine` on the executor after
a recovery has reset every worker.

Each request that completed must answer as it does alone on a roomy local engine of
the same engine configuration (tokens, text, finish reason, error, logprobs within
1e-3), one carrying a fault token must fail alone, every KV slot must be free after,
every memory worker healthy, and the deployment must still answer a request as HF.

    python -m tests.cluster.ray_workload 0 180    # seeds 0..179, one line each
    python -m tests.cluster.ray_workload 0 60 fixed    # on two compute replicas
    python -m tests.cluster.ray_workload 0 60 rotational    # on a ring of two
    python -m tests.cluster.ray_workload 0 60 --scale    # memory workers changed, 1-3

`--scale` adds 1-3 changes of the engine's memory workers (to 1-3) at random steps
(`LLMEngine.scale_memory_workers`; a kill of a memory worker a scale-down took away does
nothing) and, in 3 seeds of 10, a memory worker lost for good ("lose-memory": killed,
its replacement's start failing, so the recovery drops it and the engine goes on with
the others, renumbered; with one left, a plain kill); each seed starts again from the
deployment's two.

Its first run found what 126cdac fixes: a kill-compute while the culprit search ran an
innocent request alone got that request named (seed 23 fails at 56061ef).
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from dataclasses import dataclass, replace

import ray

from lamina.engine.engine import LLMEngine
from lamina.faults import FaultPlan
from lamina.sampling.params import SamplingParams
from tests.lamina.random_workload import (
    LAYER_POISON,
    POISON,
    TEXT,
    Ask,
    _params,
    _prompt,
    compare,
    each_seed,
    engine,
    reference_model,
    run,
    texts,
)

MEM_POS = 600  # a memory worker fails a sequence with a query here: no good one gets there
FAULTS = FaultPlan(compute_token=POISON, compute_layer=2, layer_token=LAYER_POISON,
                   memory_pos=MEM_POS)
# the deployment the workloads run on (`deployment`): the pools hold what any seed's
# engine may use; steps time out soon enough that a hung worker costs seconds
POOL_SLOTS, HOST_BYTES = 3000, 64 << 20
TIMEOUT_S = 8.0  # step and worker timeouts: a step here takes well under a second
KINDS = ("kill-memory", "kill-compute", "stop-memory", "stop-compute")


@dataclass(frozen=True)
class WorkerEvent:
    """What happens to a worker before a step."""
    at: int  # the step it happens before
    kind: str  # one of KINDS, or "scale"
    worker: int  # the memory or compute worker's index; "scale": the memory workers wanted


@dataclass(frozen=True)
class RayWorkload:
    config: dict  # the engine's EngineConfig fields beyond the deployment's
    slots: int  # of the pools' POOL_SLOTS, those the engine allocates
    asks: tuple[Ask, ...]
    events: tuple[WorkerEvent, ...]


def deployment(pipeline: str = "none", **kw):
    """The Ray `LLM` the workloads run on: 2 memory workers with session tiers, the
    fault plan, and one compute worker (`pipeline` "none") or two compute replicas
    ("fixed", "rotational"). Its steps are the workload's own, on this thread, so no
    `keeper` grows it back beside them (`regrow_interval_s` 0)."""
    from lamina import LLM

    replicas = {"none": 1, "fixed": 2, "rotational": 2}[pipeline]
    return LLM(executor="ray", num_memory_workers=2, num_kv_slots=POOL_SLOTS,
               kv_host_bytes=HOST_BYTES, faults=FAULTS, step_timeout_s=TIMEOUT_S,
               worker_timeout_s=TIMEOUT_S, num_compute_workers=replicas, pipeline=pipeline,
               regrow_interval_s=0, **kw)


def _config(r: random.Random) -> dict:
    kw = dict(max_step_tokens=r.choice([32, 96, 512, 2048]), max_batch=r.choice([2, 4, 64]),
              prefix_caching=r.random() < 0.7, speculative_tokens=r.choice([0, 0, 3]),
              scheduling_policy=r.choice(["fcfs", "priority"]), split_kv=r.random() < 0.7)
    kw["kv_host_bytes"] = HOST_BYTES if kw["prefix_caching"] and r.random() < 0.5 else 0
    return kw


def _poisoned(r: random.Random, pool: list[int], prompt: list[int],
              params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """A request that sets off one of the faults."""
    kind = r.choice(["compute", "layer", "memory"])
    if kind == "memory":  # its decode reaches MEM_POS: nothing may stop it before
        return ((pool * 3)[:MEM_POS - r.randrange(0, 8)],
                SamplingParams(max_tokens=12, temperature=params.temperature,
                               seed=params.seed, n=params.n, ignore_eos=True))
    return prompt + [POISON if kind == "compute" else LAYER_POISON], params


def workload(seed: int, lm, replicas: int = 1, scale: bool = False) -> RayWorkload:
    """Seed `seed`'s workload for a deployment of `replicas` compute workers; `scale`:
    with 1-3 changes of its memory workers (to 1-3) too."""
    r = random.Random(seed)
    pool, chat = texts(lm, "Name two rivers and the seas they reach.")
    config, slots = _config(r), r.choice([700, 1200, POOL_SLOTS])
    asks = []
    for _ in range(r.randrange(4, 12)):
        p, params = _prompt(r, pool, chat), _params(r, pool)
        if r.random() < 0.15:
            p, params = _poisoned(r, pool, p, params)
        at, priority = r.choice([0, 0, r.randrange(0, 20)]), r.randrange(-2, 3)
        if config["scheduling_policy"] == "fcfs" and priority != -2:
            priority = 0  # first come, first served refuses a priority: one ask in 5 has one
        asks.append(Ask(at, p, params, priority,
                        r.randrange(1, 30) if r.random() < 0.15 else None,
                        r.choice([None, "s1", "s2"]) if config["kv_host_bytes"] else None,
                        r.random() < 0.3))
    events = []
    for _ in range(r.choice([0, 1, 1, 2])):
        kind = r.choice(KINDS[:2] * 3 + KINDS[2:])  # a hang costs its timeout: rarer
        events.append(WorkerEvent(r.randrange(1, 25), kind,
                                  r.randrange(2) if kind.endswith("memory") else
                                  r.randrange(replicas) if replicas > 1 else 0))
    if scale:
        events += [WorkerEvent(r.randrange(1, 30), "scale", r.randrange(1, 4))
                   for _ in range(r.randrange(1, 4))]
        if r.random() < 0.3:
            events.append(WorkerEvent(r.randrange(1, 25), "lose-memory", r.randrange(2)))
    return RayWorkload(config, slots, tuple(asks), tuple(events))


def features(w: RayWorkload) -> set[str]:
    """What a workload holds, in words (for choosing seeds and checking them)."""
    out = {e.kind for e in w.events}
    c = w.config
    out |= {name for name, on in [
        ("preempts", w.slots < POOL_SLOTS), ("no-cache", not c["prefix_caching"]),
        ("drafts", c["speculative_tokens"] > 0), ("tiers", c["kv_host_bytes"] > 0),
        ("chunks", c["max_step_tokens"] <= 96)] if on}
    for a in w.asks:
        out |= {name for name, on in [
            ("memory-poison", len(a.prompt) >= MEM_POS - 8),
            ("poison", POISON in a.prompt), ("layer-poison", LAYER_POISON in a.prompt),
            ("structured", a.params.structured_outputs is not None),
            ("abort", a.abort_at is not None), ("session", a.session is not None),
            ("n", a.params.n > 1), ("sampled", a.params.temperature > 0)] if on}
    return out


def _pid(llm, e: WorkerEvent) -> int:
    ex = llm.executor
    if e.kind.endswith("memory"):
        return ex.memory_info[e.worker]["pid"]
    return ray.get(ex.computes[e.worker].ping.remote())


def _happen(llm, eng: LLMEngine, e: WorkerEvent, stopped: list[int], fired: list) -> None:
    ex = llm.executor
    if e.kind == "scale":  # `worker`: the memory workers wanted
        _scale(eng, e.worker, fired)
        return
    if e.kind.endswith("memory") and e.worker >= len(ex.memory):
        return  # a scale-down took it away
    if e.kind == "lose-memory" and len(ex.memory) > 1 and "_new_memory" not in vars(ex):
        _no_replacement(ex)  # (one at a time: the first one's recovery takes it off)
    if e.kind in ("kill-memory", "lose-memory"):
        ray.kill(ex.memory[e.worker])
    elif e.kind == "kill-compute":
        ray.kill(ex.computes[e.worker])
    else:
        try:
            pid = _pid(llm, e)
            os.kill(pid, signal.SIGSTOP)
        except (ray.exceptions.RayActorError, ProcessLookupError):
            return  # killed before (at this step, or with no step since): nothing to stop
        stopped.append(pid)
    if eng.has_unfinished():  # else the next step that needs the worker finds it
        fired.append(e.kind)


def _no_replacement(ex) -> None:
    """The next memory worker the executor starts in a dead one's place fails its start
    (its threads not a number), once."""
    from lamina.cluster.memory_worker import MemoryWorker

    def broken(i: int):
        del ex._new_memory
        home, _ = ex._memory_home(ex._homes[i])
        return MemoryWorker.options(**ex._m_opts, **home).remote(i, "no threads")
    ex._new_memory = broken


def _scale(eng: LLMEngine, n: int, fired: list) -> None:
    """The engine's memory workers -> n, as its steps go on: refused (ValueError) when a
    request needs more, by design; any other failure (a worker the engine has not yet
    found dead) leaves the engine as it was, and is noted."""
    busy = eng.has_unfinished()
    try:
        done = eng.scale_memory_workers(n)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 - noted; the workload goes on
        fired.append(f"scale-failed ({type(e).__name__})")
        return
    if busy:
        fired.append("scale" + (f" (moved {done.relocated}, preempted {done.preempted})"
                                if done.relocated or done.preempted else ""))


def fresh_engine(llm, w: RayWorkload) -> LLMEngine:
    """Every worker reset (or replaced), the deployment's memory workers as it started
    (a scale workload changes them), a new engine of the workload's configuration on
    them: as if the deployment had just started."""
    ex, m = llm.executor, llm.config.num_memory_workers
    if len(ex.memory) > m:
        ex.remove_memory_workers(m)
    elif len(ex.memory) < m:
        ex.add_memory_workers(ex.start_memory_workers(len(ex.memory), m - len(ex.memory)))
    ex.recover(RuntimeError("a new workload"))
    cfg = replace(llm.config, num_kv_slots=w.slots, **w.config)
    return LLMEngine(cfg, ex, llm.loaded.tokenizer, llm.loaded.config)


@dataclass(frozen=True)
class Outcome:
    problems: tuple[str, ...]  # what went wrong (empty: nothing)
    fired: tuple[str, ...]  # the worker events that happened while requests ran
    recoveries: int  # recoveries of the engine (failed steps brought back)
    lost: int = 0  # memory workers its recoveries dropped (no replacement started)

    def line(self, drawn: set[str]) -> tuple[list[str], str]:
        """`each_seed`'s (problems, note) for a workload that drew `drawn`."""
        return list(self.problems), (f"{sorted(drawn)} fired {list(self.fired)}, "
                                     f"{self.recoveries} recoveries"
                                     + (f", {self.lost} memory workers lost"
                                        if self.lost else ""))


def check(seed: int, llm, lm, split, scale: bool = False) -> Outcome:
    """This seed's workload on the deployment `llm`. `lm`, `split`: the model in this
    process, for the local reference."""
    w = workload(seed, lm, llm.config.num_compute_workers, scale)
    eng = fresh_engine(llm, w)
    ex, stopped, fired = llm.executor, [], []
    ex.ping_timeout_s, ex.health_timeout_s = TIMEOUT_S, TIMEOUT_S / 2
    events = {}
    for e in w.events:  # two at one step: both happen
        prev = events.get(e.at, lambda: None)
        events[e.at] = (lambda e=e, prev=prev: (prev(), _happen(llm, eng, e, stopped,
                                                                 fired)))
    t = time.monotonic()
    try:
        outs, aborted = run(eng, w.asks, events=events)
    finally:
        vars(ex).pop("_new_memory", None)  # a lost worker not found yet: replaced later
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # its replacement's start killed it
    problems = []
    free = [w.slots] * len(eng.allocs)
    if eng.free_slots() != free or any(a.stats().shared for a in eng.allocs):
        problems.append(f"slots free {eng.free_slots()}, were {free}")
    ref = engine(lm, split, {**w.config, "num_memory_workers": 2, "kv_host_bytes": 0},
                 POOL_SLOTS)
    problems += compare(w.asks, outs, aborted, ref, lambda a: POISON in a.prompt
                        or LAYER_POISON in a.prompt or len(a.prompt) >= MEM_POS - 8)
    # a worker killed after the workload's last step is found by the next one
    probe = lm.tokenizer(TEXT)["input_ids"][5:60]
    got, want = _greedy(eng, probe, 6), _greedy(ref, probe, 6)
    if got != want:
        problems.append(f"after the workload, greedy {got} against {want} alone")
    for i, m in enumerate(ex.memory):
        try:
            error = ray.get(m.health.remote(), timeout=TIMEOUT_S)["error"]
        except ray.exceptions.ActorDiedError:
            continue  # killed after its last step: the next step that needs it replaces it
        if error:
            problems.append(f"memory worker {i} after the workload: {error}")
    if time.monotonic() - t > 600:
        problems.append(f"took {time.monotonic() - t:.0f} s")
    return Outcome(tuple(problems), tuple(fired), eng.num_recoveries,
                   eng.memory_workers_lost)


def _greedy(eng: LLMEngine, prompt: list[int], n: int) -> list[int]:
    outs, _ = run(eng, [Ask(0, prompt, SamplingParams(max_tokens=n, temperature=0), 0,
                            None, None, False)])
    return outs[0].outputs[0].token_ids


def main() -> None:
    lm, split = reference_model()
    scale = "--scale" in sys.argv[3:]
    llm = deployment(next((a for a in sys.argv[3:] if not a.startswith("--")), "none"))

    def one(seed: int) -> tuple[list[str], str]:
        drawn = features(workload(seed, lm, llm.config.num_compute_workers, scale))
        return check(seed, llm, lm, split, scale).line(drawn)

    try:
        each_seed(int(sys.argv[1]), int(sys.argv[2]), one)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
