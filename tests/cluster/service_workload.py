"""Random HTTP workloads on the deploy-once path, the service's workers killed and hung
while clients wait.

The deployment is what users run: a Lamina service (`cluster/service.py`, started with
`up`) owning a Ray engine of two memory workers and one compute worker (or two compute
replicas), an HTTP front over it (`build_app` over `ServiceLoop`, what `lamina serve
--service` runs), and clients on threads. A seed draws the clients' requests as
`tests/lamina/http_workload.py` does (completions and chat, streamed or not, greedy or
seeded, n = 2, stop strings, penalties, logprobs, JSON schema; some hang up, some carry
a bad field), some more that set off the service's fault plan (a token the compute
worker refuses, a layer that raises with no sequence named, a memory worker that fails
a position), 0-2 conversations over the Responses API (stored in the service), and
0-2 things that happen to the workers at random moments: killed (`ray.kill`) or
stopped (SIGSTOP: alive and silent, so only a timeout finds it).

Each answer that completed must equal the same request sent alone through the front
after (a conversation's turn: continuing the same stored turn, and `GET` returns it);
each bad one must be a 400 naming its field; each poisoned one a 500
`request_failed` (a stream: an error event) while the others go on; after, the service
is alive, holds no request, every KV slot is free, no more requests were aborted than
clients hung up and no more failed than were poisoned.

    python -m tests.cluster.service_workload 0 40             # one compute worker
    python -m tests.cluster.service_workload 0 40 fixed       # two compute replicas
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
from dataclasses import dataclass

import ray

from lamina.engine.config import EngineConfig
from lamina.entrypoints.deploy_config import ClusterConfig, LaminaConfig
from tests.cluster.ray_workload import FAULTS, KINDS, MEM_POS, TIMEOUT_S, Outcome
from tests.lamina.http_workload import (
    COMPLETIONS,
    Chain,
    HttpAsk,
    calm,
    chain_cuts,
    chain_features,
    check_answers,
    check_chains,
    draw_asks,
    draw_chains,
    send_all,
    start_chains,
)
from tests.lamina.random_workload import LAYER_POISON, POISON, TEXT, each_seed
from tests.lamina.test_server import _Server

SLOTS = 3000


@dataclass(frozen=True)
class TimedEvent:
    """What happens to one of the service's workers, `delay` s after the clients start."""
    delay: float
    kind: str  # one of ray_workload.KINDS
    worker: int  # the memory or compute worker's index


@dataclass(frozen=True)
class ServiceWorkload:
    asks: tuple[HttpAsk, ...]
    poisoned: frozenset[int]  # the asks that set off a fault: they must fail alone
    events: tuple[TimedEvent, ...]
    chains: tuple[Chain, ...] = ()  # Responses conversations, stored in the service


def _poisoned(r: random.Random, ids: list[int]) -> HttpAsk:
    """A completion over token ids that sets off one of the fault plan's faults."""
    kind = r.choice(["compute", "layer", "memory"])
    body: dict = {"temperature": 0.0, "stream": r.random() < 0.5}
    if kind == "memory":  # its decode reaches MEM_POS
        body.update(prompt=(ids * 4)[:MEM_POS - r.randrange(0, 8)], max_tokens=12,
                    ignore_eos=True)
    else:
        start = r.randrange(0, len(ids) - 10)
        body.update(prompt=ids[start:start + r.randrange(2, 80)]
                    + [POISON if kind == "compute" else LAYER_POISON],
                    max_tokens=r.randrange(1, 12))
    return HttpAsk(r.uniform(0, 1.5), COMPLETIONS, body, None, None)


def workload(seed: int, ids: list[int], replicas: int = 1) -> ServiceWorkload:
    """Seed `seed`'s workload; `ids`: TEXT's token ids (the poisoned prompts' words)."""
    r = random.Random(seed)
    asks = list(draw_asks(r))
    poisoned = set()
    for _ in range(r.choice([0, 0, 1, 2])):
        poisoned.add(len(asks))
        asks.append(_poisoned(r, ids))
    events = []
    for _ in range(r.choice([0, 1, 1, 2])):
        kind = r.choice(KINDS[:2] * 3 + KINDS[2:])  # a hang costs its timeout: rarer
        events.append(TimedEvent(r.uniform(0.1, 3.0), kind,
                                 r.randrange(2) if kind.endswith("memory") else
                                 r.randrange(replicas)))
    # the chains from a generator of their own: the seeds drawn before them keep theirs
    return ServiceWorkload(tuple(asks), frozenset(poisoned), tuple(events),
                           draw_chains(random.Random(f"chains {seed}")))


def features(w: ServiceWorkload) -> set[str]:
    """What a workload holds, in words (for choosing seeds and checking them)."""
    out = {e.kind for e in w.events}
    for k, a in enumerate(w.asks):
        out |= {name for name, on in [
            ("poison", k in w.poisoned), ("bad", a.bad is not None),
            ("stream", a.body["stream"] and a.cut is None and a.bad is None),
            ("cut-stream", bool(a.cut)), ("cut-plain", a.cut == 0),
            ("n", a.body.get("n") == 2), ("sampled", a.body["temperature"] > 0),
            ("logprobs", "logprobs" in a.body), ("json", "response_format" in a.body)]
            if on}
    return out | chain_features(w.chains)


class Deployment:
    """A Lamina service on a local Ray instance and an HTTP front over it."""

    def __init__(self, pipeline: str = "none"):
        from lamina.cluster.client import ServiceLoop, connect
        from lamina.cluster.connect import connect_ray
        from lamina.cluster.service import up

        replicas = {"none": 1, "fixed": 2, "rotational": 2}[pipeline]
        engine = EngineConfig(num_memory_workers=2, num_kv_slots=SLOTS, max_step_tokens=256,
                              max_batch=16, faults=FAULTS, step_timeout_s=TIMEOUT_S,
                              worker_timeout_s=TIMEOUT_S, num_compute_workers=replicas,
                              pipeline=pipeline)
        if not ray.is_initialized():  # else the instance a test module before left
            connect_ray(None)
        # no restart: a stopped engine stays stopped, so a seed that stops it fails
        self.service = up(LaminaConfig(engine=engine,
                                       cluster=ClusterConfig(executor="ray", max_restarts=0)))
        self.replicas = replicas
        # a stopped worker's ping and health waits: seconds here, not the default 30 s
        ray.get(self.service.__ray_call__.remote(_short_waits))
        self.client = connect()
        self.front = _Server(ServiceLoop(self.client), self.client.tokenizer())
        self.ids = self.client.tokenizer()(TEXT)["input_ids"]

    def workers(self) -> tuple[list, list, list[int]]:
        """The service's workers now: (compute handles, memory handles, memory pids)."""
        return ray.get(self.service.__ray_call__.remote(_workers), timeout=30)

    def close(self, shutdown_ray: bool = True) -> None:
        from lamina.cluster.service import down

        self.front.stop()
        try:
            down()
        finally:
            if shutdown_ray:
                ray.shutdown()


def _short_waits(service) -> None:
    ex = service.llm.executor
    ex.ping_timeout_s, ex.health_timeout_s = TIMEOUT_S, TIMEOUT_S / 2


def _workers(service) -> tuple[list, list, list[int]]:
    ex = service.llm.executor
    return list(ex.computes), list(ex.memory), [i["pid"] for i in ex.memory_info]


def _happen(d: Deployment, e: TimedEvent, stopped: list[int], fired: list[str]) -> None:
    computes, memory, pids = d.workers()
    if e.kind == "kill-memory":
        ray.kill(memory[e.worker])
    elif e.kind == "kill-compute":
        ray.kill(computes[e.worker])
    else:
        try:
            pid = (pids[e.worker] if e.kind == "stop-memory" else
                   ray.get(computes[e.worker].ping.remote(), timeout=TIMEOUT_S))
            os.kill(pid, signal.SIGSTOP)
        except (ray.exceptions.RayError, ProcessLookupError):
            return  # dead or stopped already: nothing to stop
        stopped.append(pid)
    s = d.client.status()
    if s["running"] or s["waiting"]:
        fired.append(e.kind)


def check(seed: int, d: Deployment) -> Outcome:
    """This seed's workload through the deployment `d`."""
    w = workload(seed, d.ids, d.replicas)
    before = d.client.status()
    stopped: list[int] = []
    fired: list[str] = []
    timers = [threading.Timer(e.delay, _happen, (d, e, stopped, fired)) for e in w.events]
    for t in timers:
        t.start()
    talks = start_chains(d.front.port, w.chains)
    try:
        answers, problems = send_all(d.front.port, w.asks)
    finally:
        chained, late = talks()
        problems += late
        for t in timers:
            t.join(60)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # its replacement's start killed it
    after = _settled(d.client, 60)
    if after is None:
        return Outcome(("requests still in the service 60 s after the last answer",
                        *problems), tuple(fired), 0)
    if not after["alive"]:
        return Outcome((f"the service stopped: {after['error']}", *problems), tuple(fired),
                       after["recoveries"] - before["recoveries"])
    cuts = sum(a.cut for a in answers.values()) + chain_cuts(chained)
    aborted, failed = (after[k] - before[k] for k in ("aborted", "failed"))
    if aborted > cuts:
        problems.append(f"{aborted} requests aborted, {cuts} clients hung up")
    if failed != len(w.poisoned):
        problems.append(f"{failed} requests failed, {len(w.poisoned)} poisoned")
    for k in sorted(w.poisoned):
        problems += _failed_alone(k, answers.get(k))
    problems += check_answers(d.front.port, w.asks, answers, skip=w.poisoned)
    problems += check_chains(d.front.port, w.chains, chained)
    if [x["free"] for x in after["kv"]] != [SLOTS] * len(after["kv"]):
        problems.append(f"KV slots free after: {after['kv']}")
    return Outcome(tuple(problems), tuple(fired), after["recoveries"] - before["recoveries"])


def _failed_alone(k: int, got) -> list[str]:
    """A poisoned ask's answer: a 500 naming the failure, or a stream's error event."""
    if got is None:
        return []  # no answer at all: send_all says so
    if got.events is not None:
        if not any(isinstance(e, dict) and "error" in e for e in got.events):
            return [f"poisoned ask {k}: a stream without an error event: {got.events[-2:]}"]
        return []
    code = (got.body or {}).get("error", {}).get("code")
    return [] if got.status == 500 and code == "request_failed" else [
        f"poisoned ask {k}: {got.status} {got.body}"]


def _settled(client, timeout: float) -> dict | None:
    """The service's status once it has held no request for a second (a request whose
    client hung up may still be on its way in) or it stopped; None if neither happened
    within `timeout`."""
    seen = []

    def busy() -> bool:
        seen.append(s := client.status())
        return s["alive"] and bool(s["running"] or s["waiting"])

    return seen[-1] if calm(busy, timeout) else None


def main() -> None:

    def one(seed: int) -> tuple[list[str], str]:
        nonlocal d
        if not d.client.status()["alive"]:  # a seed before stopped it: deploy again
            d.close()
            d = Deployment(pipeline)
        return check(seed, d).line(features(workload(seed, d.ids, d.replicas)))

    pipeline = sys.argv[3] if len(sys.argv) > 3 else "none"
    d = Deployment(pipeline)
    try:
        each_seed(int(sys.argv[1]), int(sys.argv[2]), one)
    finally:
        d.close()


if __name__ == "__main__":
    main()
